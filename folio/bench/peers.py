"""The peers of `folio bench throughput` and `folio bench latency`, from the benchmark
process: which peers there are, their options, starting each in a child and reading back its
result (or, for a peer killed at ``--peer-timeout``, what it had finished).

Peers run the *same* requests on the *same* weights, dtype and device (folio's: the GPU when folio
ran there), each in its own spawned process, so its peak RSS (VmHWM of that process) is its own
and not mixed with folio's. What each peer runs is folio.bench.transformers_peers.

Every peer child is killed after ``--peer-timeout`` seconds (load included); the throughput
peers write their progress to a file as they go, so a killed peer still reports what it had
finished (`timed_out_result`).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import tempfile
from typing import Any, Callable

from folio.bench.child_process import ChildDied, ChildTimeout, in_child, read_progress
from folio.bench.datasets import SampleRequest
from folio.bench.results import EngineResult
from folio.bench.transformers_peers import (LatencySchedule, transformers_cb_peer,
                                            transformers_latency_peer, transformers_static_peer)

PEERS = ("none", "transformers", "transformers-cb")
DEFAULT_PEER_TIMEOUT_S = 300.0
DEFAULT_CB_MAX_BATCH_TOKENS = 8192   # transformers' own default (5.24) for max_batch_tokens


def add_peer_timeout_arg(group: Any) -> None:
    group.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT_S,
                       help="seconds after which a peer's child process (load, set-up and run) is "
                            "killed and reported as not finished; 0 = no limit")


def peer_timeout(args: argparse.Namespace) -> float | None:
    value = getattr(args, "peer_timeout", None)
    if value is None or value == 0:
        return None
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"--peer-timeout must be >= 0 (0 = no limit), got {value}")
    return float(value)


def run_peer(peer: str, info: dict, requests: list[SampleRequest],
             args: argparse.Namespace) -> EngineResult:
    source = info["model_source"]
    if source["kind"] != "hf_dir":
        return EngineResult(engine=peer, error=(
            f"skipped: the model is a {source['kind']} file ({source['path']}); the transformers "
            "peer needs a Hugging Face directory with the same weights"))
    worker: Callable[..., dict] = transformers_static_peer if peer == "transformers" \
        else transformers_cb_peer
    payload = [(r.prompt_token_ids, r.expected_output_len) for r in requests]
    options = {"batch_size": args.peer_batch_size, "temperature": args.temperature,
               "seed": args.seed,
               "cb_max_batch_tokens": getattr(args, "peer_cb_max_batch_tokens", None)
               or DEFAULT_CB_MAX_BATCH_TOKENS}
    timeout = peer_timeout(args)
    device = info.get("device") or "cpu"
    print(f"running peer {peer} on {len(payload)} requests ({device}"
          + (f", timeout {timeout:g} s" if timeout else "") + ") ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="folio-peer-") as tmp:
        progress_path = os.path.join(tmp, "progress.json")
        try:
            out = in_child(worker, source["path"], info["dtype"] or "float32", device, payload,
                           options, progress_path, timeout=timeout)
        except ChildTimeout as exc:
            return timed_out_result(peer, exc.timeout, read_progress(progress_path))
        except Exception as exc:  # the child died (out of memory...) or could not start
            return EngineResult(engine=peer, error=f"{type(exc).__name__}: {exc}")
    return EngineResult(**out)


def timed_out_result(peer: str, timeout: float, progress: dict[str, Any]) -> EngineResult:
    """The result of a peer killed at its timeout: an error, plus what it had finished by its
    last progress report (finished requests only, so the rate is a lower bound)."""
    result = EngineResult(engine=peer, error=f"did not finish in {timeout:g} s (killed)")
    result.load_s = float(progress.get("load_s") or 0.0)
    result.baseline_rss_bytes = int(progress.get("baseline_rss_bytes") or 0)
    result.memory_note = "unknown: the peer's process was killed at its timeout"
    partial: dict[str, Any] | None = None
    elapsed = float(progress.get("elapsed_s") or 0.0)
    if progress.get("phase") == "generating" and elapsed > 0:
        tokens = int(progress.get("output_tokens") or 0)
        partial = {"finished_requests": int(progress.get("finished_requests") or 0),
                   "total_requests": int(progress.get("total_requests") or 0),
                   "output_tokens": tokens, "elapsed_s": elapsed,
                   "output_tokens_per_s_lower_bound": tokens / elapsed}
    result.extra = {"timed_out": True, "timeout_s": timeout,
                    "phase": progress.get("phase", "starting"), "partial": partial,
                    **({"attn_implementation": progress["attn_implementation"]}
                       if progress.get("attn_implementation") else {})}
    return result


def release_device_memory() -> tuple[int, int] | None:
    """Collect garbage, then give the CUDA caching allocator's free blocks back to the driver, so
    a peer's child process can use the memory folio's released engine held. Returns (free,
    total) GPU bytes, or None where this process never used CUDA."""
    gc.unfreeze()  # the engine froze its objects; cycles among them must be collectable
    gc.collect()
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def describe_free_memory(free_total: tuple[int, int] | None) -> str | None:
    if free_total is None:
        return None
    free, total = free_total
    return f"GPU memory free for the peer: {free / 2**30:.1f} of {total / 2**30:.1f} GiB"


def run_llama_cpp_latency_peer(gguf_path: str | None, threads: int, n_ctx: int,
                               schedule: LatencySchedule, timeout: float | None
                               ) -> dict[str, Any]:
    """Run `schedule` through llama.cpp (llama-cpp-python) on `gguf_path` in a child process;
    the same result keys as run_latency_peer."""
    from folio.bench.llama_cpp_peers import llama_cpp_latency_peer
    base: dict[str, Any] = {"engine": "llama.cpp", "error": None}
    if gguf_path is None:
        return {**base, "error": "skipped: the model is not a GGUF file (llama.cpp reads GGUF)"}
    print(f"running peer llama.cpp on cpu ({threads} threads"
          + (f", timeout {timeout:g} s" if timeout else "") + ") ...", flush=True)
    from folio.bench.llama_cpp_tools import crash_signal, repack_attempts
    crashed = None
    for repack in repack_attempts("auto"):
        with tempfile.TemporaryDirectory(prefix="folio-peer-") as tmp:
            progress_path = os.path.join(tmp, "progress.json")
            try:
                out = in_child(llama_cpp_latency_peer, gguf_path, threads, n_ctx, schedule,
                               progress_path, repack, timeout=timeout)
            except ChildTimeout as exc:
                return {**base, "error": f"did not finish in {exc.timeout:g} s (killed)",
                        "timed_out": True}
            except ChildDied as exc:
                signal_name = crash_signal(exc.exitcode)
                if signal_name is None or not repack:
                    return {**base, "error": str(exc)}
                # llama.cpp's AMX matmul crashes on some AMX machines (llama_cpp_tools.py):
                # once more without its repacked weight buffers, as `--no-repack` does.
                crashed = signal_name
                print(f"peer llama.cpp died of {signal_name} with weight repacking on; "
                      "running it again without", flush=True)
                continue
            except Exception as exc:
                return {**base, "error": f"{type(exc).__name__}: {exc}"}
        if crashed:
            out["note"] = (f"the first run (weight repacking on) died of {crashed}: ran again "
                           "without repacking")
        return out
    return {**base, "error": "no run finished"}


def run_latency_peer(model_source: dict[str, str], dtype: str | None, device: str | None,
                     schedule: LatencySchedule, timeout: float | None) -> dict[str, Any]:
    """Run `schedule` through transformers' static-cache `generate` in a child process. Returns
    {"engine", "error", "load_s", "latencies", "prefill_latencies", ...} (times in seconds)."""
    base: dict[str, Any] = {"engine": "transformers", "error": None}
    if model_source["kind"] != "hf_dir":
        return {**base, "error": (
            f"skipped: the model is a {model_source['kind']} file ({model_source['path']}); "
            "the transformers peer needs a Hugging Face directory with the same weights")}
    print(f"running peer transformers (static cache) on {device or 'cpu'}"
          + (f", timeout {timeout:g} s" if timeout else "") + " ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="folio-peer-") as tmp:
        progress_path = os.path.join(tmp, "progress.json")
        try:
            return in_child(transformers_latency_peer, model_source["path"], dtype or "float32",
                            device or "cpu", schedule, progress_path, timeout=timeout)
        except ChildTimeout as exc:
            progress = read_progress(progress_path)
            return {**base, "error": f"did not finish in {exc.timeout:g} s (killed)",
                    "timed_out": True, "phase": progress.get("phase", "starting"),
                    "load_s": progress.get("load_s"),
                    "calls_done": progress.get("calls_done", 0),
                    "calls_total": len(schedule)}
        except Exception as exc:
            return {**base, "error": f"{type(exc).__name__}: {exc}"}

