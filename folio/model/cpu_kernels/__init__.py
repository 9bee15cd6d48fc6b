"""folio's C++ CPU kernels (csrc/): the 4-bit-plane and int8 matmuls of folio.model.quant, the
paged attention of folio.model.attention.cpu_backend, the float32 RMSNorm / rotary /
SiLU-and-mul of folio.model.layers, and a Llama-form decoder layer built from them
(folio.model.cpu_layer: one call per layer and step).

One extension, compiled on first use with torch's extension builder and cached
(TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions): the first start on a machine takes about
a minute, later ones load the built library. The extension's name carries a hash of the
sources and flags (`_extension_name`), so a changed source builds into a directory of its own:
torch's builder keys its build directory by name only, and two checkouts of different sources
(or an edited kernel whose bindings changed) sharing one name would rebuild over each other's
library, or load one built from the other's sources; two checkouts of the same sources get
a directory each too (the include path differs). Built for the machine it runs on
(-march=native), with OpenMP so that at::parallel_for uses torch's threads.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_NAME = "folio_cpu_kernels"
_SOURCES = ("bindings.cpp", "q4_matmul.cpp", "int8_matmul.cpp", "paged_attention.cpp",
            "elementwise.cpp", "decoder_layer.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# The instruction set csrc/simd.h writes the kernels for follows -march: AVX-512, AVX2 + FMA, or
# portable loops. Tests build the other variants with `_build(march=...)`.
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()


def _extension_name(here: str, cflags: tuple[str, ...] = tuple(_CFLAGS)) -> str:
    """`_NAME` plus a hash of every file in csrc/ (the headers too), the flags and csrc/'s
    path: one build directory per version of the sources and checkout. (The path is in the
    build's command lines, as its include directory: two checkouts of the same sources
    sharing a directory rebuilt it in turn, minutes each on 2 cores, whenever one started
    after the other.)"""
    digest = hashlib.sha256(repr((list(cflags), _LDFLAGS, os.path.abspath(here))).encode())
    for name in sorted(os.listdir(here)):
        digest.update(name.encode())
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return f"{_NAME}_{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Hold an flock on the build directory while torch's builder runs, and clear a `lock`
    file no live holder owns. torch's builder takes the directory by creating `lock` and waits,
    polling forever, while one exists; a process killed mid-build (an interrupted first start)
    leaves it behind, and every later start on the machine then hung without a word. The
    flock is released by the kernel when its holder dies, so whoever holds it knows any `lock`
    file is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "folio_build.flock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a build that did not finish", stale)
            os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def _build(march: str = "native", simd_only: bool = False) -> Any:
    """The extension built for -march=`march`; `simd_only`: only the kernels written over
    csrc/simd.h (q4_matmul, int8_matmul, paged_attention, silu_and_mul: one fewer source to
    compile, for the tests of another instruction set's branch)."""
    from torch.utils.cpp_extension import _get_build_directory, load
    here = os.path.join(os.path.dirname(__file__), "csrc")
    cflags = tuple(f"-march={march}" if f.startswith("-march=") else f for f in _CFLAGS)
    sources = _SOURCES
    if simd_only:
        cflags += ("-DFOLIO_SIMD_KERNELS_ONLY",)
        sources = ("bindings.cpp", "q4_matmul.cpp", "int8_matmul.cpp", "paged_attention.cpp",
                   "elementwise.cpp")
    name = _extension_name(here, cflags)
    build_dir = _get_build_directory(name, verbose=False)
    with _build_lock(build_dir):
        logger.info("loading folio's CPU kernels (built on first use in this checkout)")
        return load(name=name, sources=[os.path.join(here, s) for s in sources],
                    verbose=False, extra_include_paths=[here], extra_cflags=list(cflags),
                    extra_ldflags=_LDFLAGS, build_directory=build_dir)


def extension() -> Any:
    """The compiled module (one build per process, under a lock: two threads must not race on
    the build directory). Raises what the build raised (no compiler, a compile error)."""
    with _lock:
        return _build()


@functools.lru_cache(maxsize=1)
def loaded() -> Any | None:
    """The compiled module, or None where the kernels cannot be built here (the failure is
    logged once, and callers fall back to their torch code). Cached: layers ask on every
    call."""
    try:
        return extension()
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        logger.warning("folio's CPU kernels could not be built (%s: %s); using torch's ops",
                       type(exc).__name__, exc)
        return None
