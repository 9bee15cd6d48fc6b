#!/usr/bin/env bash
# Builds the llama.cpp peers of `folio bench` from source, once, outside the repo:
#   - llama.cpp's shared libraries plus `llama-server`, `llama-batched-bench`, `llama-bench`
#     (from the llama.cpp that llama-cpp-python vendors, so both peers run the same code);
#   - llama-cpp-python installed into the given Python, told (LLAMA_BUILD=OFF) not to build a
#     second copy: it loads the libraries above through LLAMA_CPP_LIB_PATH.
# Usage: tools/build_llama_cpp.sh [PREFIX] [PYTHON]   (default ~/.cache/folio/llama.cpp, .venv)
# Prints the environment lines that `folio bench --peer llama.cpp...` reads.
set -euo pipefail
VERSION=0.3.36
PREFIX=${1:-$HOME/.cache/folio/llama.cpp}
PY=${2:-.venv/bin/python}
JOBS=$(nproc)
mkdir -p "$PREFIX"
SRC="$PREFIX/llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PREFIX"
  tar xzf "$PREFIX/llama_cpp_python-$VERSION.tar.gz" -C "$PREFIX"
fi
BUILD="$PREFIX/build"
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-batched-bench llama-bench
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install -q --no-deps \
  "$SRC" diskcache jinja2 typing-extensions
echo "FOLIO_LLAMA_CPP_BIN=$BUILD/bin"
echo "LLAMA_CPP_LIB_PATH=$BUILD/bin"
