"""What the llama.cpp peers of `folio bench` run, in the peer's child process: llama.cpp through
llama-cpp-python, on the same GGUF file folio loaded, with as many threads as folio's torch.

llama-cpp-python and the llama.cpp binaries are built from source by tools/build_llama_cpp.sh
(not a dependency of folio: a benchmark peer). Its libraries are found through
LLAMA_CPP_LIB_PATH, else in the build script's default place (DEFAULT_BUILD_DIR).

The latency peer replays folio's schedule call for call: each call is one sequence at a time
(llama-cpp-python's Llama serves one sequence; a batch of B prompts runs as B sequential
generations, so its latency is the sum), greedy, exactly max_tokens new tokens with EOS
ignored (`Llama.generate` does not stop at EOS; the loop stops at max_tokens), the KV cache
reset before each prompt so no prefix is reused.
"""
from __future__ import annotations

import os
import time
from typing import Any

from folio.bench.child_process import Progress
from folio.bench.results import current_rss_bytes, peak_rss_bytes
from folio.bench.transformers_peers import latency_result, replay_latency_schedule

DEFAULT_BUILD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "folio", "llama.cpp",
                                 "build", "bin")
LIB_PATH_VAR = "LLAMA_CPP_LIB_PATH"


def import_llama_cpp() -> Any:
    """llama_cpp, pointed at the source build's libraries; ImportError with the build command
    when it is missing."""
    if not os.environ.get(LIB_PATH_VAR) and os.path.isdir(DEFAULT_BUILD_DIR):
        os.environ[LIB_PATH_VAR] = DEFAULT_BUILD_DIR
    try:
        import llama_cpp
    except (ImportError, FileNotFoundError, OSError) as exc:
        raise ImportError(f"llama-cpp-python is not usable here ({exc}); build it with "
                          "tools/build_llama_cpp.sh and set LLAMA_CPP_LIB_PATH as it prints") \
            from exc
    return llama_cpp


def _without_repacking(llama_cpp: Any) -> None:
    """Model parameters without llama.cpp's extra CPU buffer types (its weight repacking, the
    AMX one included), as `--no-repack` gives the llama.cpp binaries: llama-cpp-python builds
    its Llama's parameters from its low-level module's llama_model_default_params, so that
    default is changed here, in the peer's own child process."""
    lowlevel = llama_cpp.llama_cpp
    defaults = lowlevel.llama_model_default_params

    def no_extra_bufts() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    lowlevel.llama_model_default_params = no_extra_bufts


def llama_cpp_latency_peer(gguf_path: str, threads: int, n_ctx: int, schedule: list,
                           progress_path: str | None = None,
                           repack: bool = True) -> dict[str, Any]:
    out = latency_result("llama.cpp")
    progress = Progress(progress_path)
    try:
        progress.update(force=True, phase="loading")
        llama_cpp = import_llama_cpp()
        if not repack:
            _without_repacking(llama_cpp)
        out["baseline_rss_bytes"] = current_rss_bytes()
        start = time.perf_counter()
        llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        out["load_s"] = time.perf_counter() - start

        def one(prompt: list[int], max_tokens: int) -> None:
            llm.reset()
            made = 0
            for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
                made += 1
                if made == max_tokens:
                    break

        def call(prompts: list[list[int]], max_tokens: int) -> float:
            begin = time.perf_counter()
            for prompt in prompts:
                one(prompt, max_tokens)
            return time.perf_counter() - begin

        replay_latency_schedule(schedule, call, out, progress)
        out["device"] = "cpu"
        out["dtype"] = "GGUF as stored"
        out["attn_implementation"] = (f"llama.cpp {llama_cpp.__version__}, {threads} threads"
                                      + ("" if repack else ", no weight repacking"))
        out["sequential_batch"] = len(schedule[0][2]) > 1 if schedule else False
    except Exception as exc:  # noqa: BLE001 - reported as the peer's error
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out
