"""The peers of `folio bench throughput` and `folio bench latency`: transformers on the same
requests, weights, dtype and device.

Peers run the *same* requests on the *same* weights, dtype and device (folio's: the GPU when folio
ran there), each in its own spawned process, so its peak RSS (VmHWM of that process) is its own
and not mixed with folio's:

* ``transformers``: `model.generate` in static, left-padded batches of ``--peer-batch-size``
  requests, each batch generating ``max(output_len)`` tokens for every row. The padding waste
  is part of the peer's real cost, but only the tokens each request asked for count as output.
* ``transformers-cb``: transformers' own continuous batching (`init_continuous_batching`, the
  engine under `generate_batch`: paged KV cache, per-request max_new_tokens) with
  ``attn_implementation="paged|sdpa"`` (transformers >= 5.2x spells it "sdpa" and warns about
  the prefix, which `_load_peer_model` then drops), the KV cache sized to hold the whole
  workload at once and ``--peer-cb-max-batch-tokens`` tokens per step.
* ``bench latency --peer transformers``: `model.generate` with ``cache_implementation="static"``
  (no torch.compile) on exactly the prompts folio's latency bench timed, in the same order.

Every peer child is killed after ``--peer-timeout`` seconds (load included); the throughput
peers write their progress to a file as they go, so a killed peer still reports what it had
finished (`timed_out_result`).

The functions handed to the spawned child (`_transformers_static_peer`, `_transformers_cb_peer`,
`_transformers_latency_peer`) are top-level functions of this module, so the child can import
them by name.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any, Callable

from folio.bench.datasets import SampleRequest
from folio.bench.results import EngineResult, current_rss_bytes, peak_rss_bytes

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


# ------------------------------------------------------------------------------------------
# Running a peer (from the benchmark process)
# ------------------------------------------------------------------------------------------

def run_peer(peer: str, info: dict, requests: list[SampleRequest],
             args: argparse.Namespace) -> EngineResult:
    source = info["model_source"]
    if source["kind"] != "hf_dir":
        return EngineResult(engine=peer, error=(
            f"skipped: the model is a {source['kind']} file ({source['path']}); the transformers "
            "peer needs a Hugging Face directory with the same weights"))
    worker: Callable[..., dict] = _transformers_static_peer if peer == "transformers" \
        else _transformers_cb_peer
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


# ------------------------------------------------------------------------------------------
# Shared by the benches: random-model build and start-to-ready reporting
# ------------------------------------------------------------------------------------------

def build_random_model_in_child(name: str, num_layers: int | None) -> dict[str, Any]:
    """`build_random_model_info` in a spawned child (the builder's peak memory and CUDA context
    stay out of the benchmark process), plus "wall_s": the child's whole time, spawn included.
    Prints one line about the model."""
    from folio.bench.random_model import build_random_model_info
    start = time.perf_counter()
    info = in_child(build_random_model_info, name, None, num_layers)
    info["wall_s"] = time.perf_counter() - start
    how = (f"built in {info['build_s']:.1f} s (generator: {info['generator']})" if info["built"]
           else "cached")
    print(f"random-weights model ({name}): {info['path']} [{how}; {info['wall_s']:.1f} s wall]",
          flush=True)
    return info


def startup_breakdown(total_s: float, timings: dict[str, float] | None) -> dict[str, float]:
    """Start-to-ready (seconds from constructing `LLM(...)` to its return) split into the worker's
    stages (model load, KV profiling, KV allocation, CUDA graph capture: 0.0 when a stage did not
    run) and "other_s" (config, tokenizer, scheduler: the rest)."""
    from folio.worker.worker import STARTUP_STAGES  # here: peers' children need not load it
    stages = {key: float((timings or {}).get(key, 0.0)) for key in STARTUP_STAGES}
    return {"total_s": total_s, **stages, "other_s": max(0.0, total_s - sum(stages.values()))}


def format_startup(startup: dict[str, float]) -> str:
    from folio.worker.worker import STARTUP_STAGES
    parts = [f"{label} {startup[key]:.1f} s" for key, label in STARTUP_STAGES.items()
             if startup.get(key, 0.0) >= 0.05 or key == "load_s"]
    parts.append(f"other {startup.get('other_s', 0.0):.1f} s")
    return f"start-to-ready: {startup['total_s']:.1f} s ({', '.join(parts)})"


# ------------------------------------------------------------------------------------------
# Child processes
# ------------------------------------------------------------------------------------------

class ChildTimeout(TimeoutError):
    """`in_child` killed the child at its timeout."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"did not finish in {timeout:g} s")
        self.timeout = timeout


class ChildTraceback(Exception):
    """The child's traceback, chained as the cause of the exception it raised."""


def in_child(fn: Callable[..., Any], *fn_args: Any, timeout: float | None = None) -> Any:
    """Run fn(*fn_args) in a fresh spawned process and return its result: its peak RSS is then
    its own, and a crash or leak there cannot disturb the benchmark process. An exception in the
    child is raised here (its traceback as the cause). With `timeout` (seconds), a child still
    running then is killed and ChildTimeout raised."""
    ctx = get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child_main, args=(sender, fn, fn_args), name="folio-bench-child")
    process.start()
    sender.close()  # the child holds the only write end: EOF here when it dies
    message = None
    answered = False
    try:
        if not receiver.poll(timeout):
            raise ChildTimeout(timeout)
        try:
            message = receiver.recv()
        except EOFError:
            pass
        answered = True
    finally:
        receiver.close()
        if answered:
            process.join(timeout=60)  # it exits right after answering
        if process.is_alive():
            process.kill()
        process.join()
    if message is None:
        raise RuntimeError(f"the child process died (exit code {process.exitcode}) before "
                           "returning a result")
    status, payload, child_tb = message
    if status == "ok":
        return payload
    raise payload from ChildTraceback(child_tb)


def _child_main(sender: Any, fn: Callable[..., Any], fn_args: tuple) -> None:
    try:
        message = ("ok", fn(*fn_args), None)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        child_tb = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # an exception that does not survive pickling: keep its text
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        message = ("error", exc, child_tb)
    try:
        sender.send(message)
    finally:
        sender.close()


class _Progress:
    """A peer's progress, written as JSON to `path` (atomically, at most every `interval` s unless
    forced) so the parent can read how far a killed peer got. No-op without a path."""

    def __init__(self, path: str | None, interval: float = 0.5) -> None:
        self.path = path
        self.interval = interval
        self.state: dict[str, Any] = {}
        self._last = -math.inf

    def update(self, force: bool = False, **fields: Any) -> None:
        self.state.update(fields)
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.path)


def read_progress(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------
# Peers (each runs inside a spawned child)
# ------------------------------------------------------------------------------------------

def _load_peer_model(model_dir: str, dtype_name: str, device: str, result: EngineResult,
                     attn_implementation: str | None = None) -> Any:
    """The model on `device` in `dtype_name`. A "paged|X" implementation that this transformers
    version rejects is retried as plain "X" (recent versions dropped the prefix)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    result.baseline_rss_bytes = current_rss_bytes()
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype_name)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with warnings.catch_warnings():
        # transformers >= 5.2x: "The `paged|` prefix is no longer needed" (it maps to plain sdpa)
        warnings.filterwarnings("ignore", message=".*paged\\|.*", category=FutureWarning)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except (ValueError, KeyError, ImportError):
            if not (attn_implementation or "").startswith("paged|"):
                raise
            kwargs["attn_implementation"] = attn_implementation.removeprefix("paged|")
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.to(torch.device(device))
    model.eval()
    _synchronize(device)
    result.load_s = time.perf_counter() - start
    return model


def _synchronize(device: str) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def _peer_generation_config(model: Any, temperature: float, max_new_tokens: int) -> Any:
    """The folio requests' sampling (temperature, top_p=1, no top-k), built from scratch so a
    generation_config.json in the directory cannot add processors folio does not run."""
    from transformers import GenerationConfig
    eos = model.config.eos_token_id
    sample = temperature > 0
    return GenerationConfig(
        do_sample=sample, temperature=temperature if sample else None,
        top_p=1.0 if sample else None, top_k=0 if sample else None,
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        pad_token_id=_pad_id(model), eos_token_id=eos)


def _pad_id(model: Any) -> int:
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id
    return int(pad if pad is not None else (eos if isinstance(eos, int) else 0))


def _transformers_static_peer(model_dir: str, dtype_name: str, device: str,
                              payload: list[tuple[list[int], int]], options: dict[str, Any],
                              progress_path: str | None = None) -> dict:
    """HF `generate` in static batches of options["batch_size"] requests, in request order,
    left-padded; each batch runs to its longest requested output (min_new_tokens =
    max_new_tokens, so EOS cannot end a row early: the equivalent of ignore_eos)."""
    import torch
    result = EngineResult(engine="transformers")
    progress = _Progress(progress_path)
    batch_size, temperature = options["batch_size"], options["temperature"]
    try:
        torch.manual_seed(options["seed"])
        progress.update(force=True, phase="loading", baseline_rss_bytes=current_rss_bytes())
        model = _load_peer_model(model_dir, dtype_name, device, result)
        gen_pad = _pad_id(model)
        useful = generated = prompt_tokens = finished = 0
        progress.update(force=True, phase="generating", load_s=result.load_s, elapsed_s=0.0,
                        finished_requests=0, output_tokens=0, total_requests=len(payload))
        start = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, len(payload), batch_size):
                batch = payload[first:first + batch_size]
                width = max(len(ids) for ids, _ in batch)
                steps = max(out_len for _, out_len in batch)
                input_ids = torch.full((len(batch), width), gen_pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, (ids, _) in enumerate(batch):
                    input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
                    mask[row, width - len(ids):] = 1
                out = model.generate(input_ids=input_ids.to(model.device),
                                     attention_mask=mask.to(model.device),
                                     generation_config=_peer_generation_config(
                                         model, temperature, steps))
                made = out.shape[1] - width
                if made != steps:
                    raise RuntimeError(f"generate made {made} tokens per row, expected {steps}")
                generated += made * len(batch)
                useful += sum(out_len for _, out_len in batch)
                prompt_tokens += sum(len(ids) for ids, _ in batch)
                finished += len(batch)
                progress.update(force=True, elapsed_s=time.perf_counter() - start,
                                finished_requests=finished, output_tokens=useful)
        _synchronize(device)
        result.elapsed_s = time.perf_counter() - start
        result.num_requests = len(payload)
        result.prompt_tokens = prompt_tokens
        result.output_tokens = useful
        result.generated_tokens = generated
        result.extra = {"batch_size": batch_size, "padding_waste_tokens": generated - useful,
                        "attn_implementation": model.config._attn_implementation,
                        "device": str(model.device)}
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.peak_rss_bytes = peak_rss_bytes()
    result.memory_note = "VmHWM of the peer's own spawned process"
    return asdict(result)


def _import_cb_config_class() -> Any:
    """transformers' ContinuousBatchingConfig, wherever this version keeps it (None if absent)."""
    import importlib
    for module in ("transformers.generation.configuration_utils",
                   "transformers.generation.continuous_batching.continuous_api",
                   "transformers.generation", "transformers"):
        try:
            cls = getattr(importlib.import_module(module), "ContinuousBatchingConfig", None)
        except Exception:
            cls = None
        if cls is not None:
            return cls
    return None


def cb_sizes(payload: list[tuple[list[int], int]], page_size: int,
             max_batch_tokens: int) -> dict[str, int]:
    """The continuous batching peer's KV cache and step sizes: enough blocks of `page_size`
    tokens to hold every request at once (each request's prompt + output, rounded up, plus one
    block of slack each), so no request waits for cache space or is evicted; and
    `max_batch_tokens` tokens per step, capped by what the whole workload could ever schedule
    in one step (every prompt plus one token per request)."""
    num_blocks = sum(-(-(len(prompt) + out_len) // page_size) + 1 for prompt, out_len in payload)
    cap = sum(len(prompt) for prompt, _ in payload) + len(payload)
    return {"num_blocks": num_blocks + 8, "max_batch_tokens": max(1, min(max_batch_tokens, cap))}


def _cb_init_kwargs(model: Any, gen_config: Any, payload: list[tuple[list[int], int]],
                    options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments for `init_continuous_batching` that this transformers version takes,
    and the settings applied (for the report)."""
    import dataclasses
    import inspect
    accepted = inspect.signature(model.init_continuous_batching).parameters
    kwargs: dict[str, Any] = {"generation_config": gen_config}
    applied: dict[str, Any] = {}
    longest_out = max(out_len for _, out_len in payload)
    if "workload_hints" in accepted:
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(len(ids) for ids, _ in payload),
                max_generated_length=longest_out, num_requests=len(payload))
        except Exception:
            pass  # the manager picks its own defaults
    config_cls = _import_cb_config_class()
    if config_cls is not None and "continuous_batching_config" in accepted:
        fields = ({f.name for f in dataclasses.fields(config_cls)}
                  if dataclasses.is_dataclass(config_cls)
                  else set(inspect.signature(config_cls).parameters))
        defaults = config_cls()
        page_size = int(getattr(defaults, "page_size", None)
                        or getattr(defaults, "block_size", None) or 256)
        wanted: dict[str, Any] = cb_sizes(payload, page_size, options["cb_max_batch_tokens"])
        # Keep the implementation asked for (paged sdpa), rather than a flash kernel that
        # transformers might find (or try to download) on its own.
        wanted["auto_switch_to_flash"] = False
        applied = {k: v for k, v in wanted.items() if k in fields}
        kwargs["continuous_batching_config"] = config_cls(**applied)
        applied["page_size"] = page_size
    return kwargs, applied


def _transformers_cb_peer(model_dir: str, dtype_name: str, device: str,
                          payload: list[tuple[list[int], int]], options: dict[str, Any],
                          progress_path: str | None = None) -> dict:
    """transformers' continuous batching with paged sdpa attention: every request queued at once
    with its own max_new_tokens and EOS disabled (-1), like folio's ignore_eos. The manager's
    set-up and warm-up are counted in load_s, as folio's start-up is."""
    import torch
    result = EngineResult(engine="transformers-cb")
    progress = _Progress(progress_path)
    manager = None
    try:
        from transformers import GenerationMixin
        if not hasattr(GenerationMixin, "init_continuous_batching"):
            raise RuntimeError("this transformers version has no continuous batching API")
        torch.manual_seed(options["seed"])
        progress.update(force=True, phase="loading", baseline_rss_bytes=current_rss_bytes())
        model = _load_peer_model(model_dir, dtype_name, device, result,
                                 attn_implementation="paged|sdpa")
        longest_out = max(out_len for _, out_len in payload)
        gen_config = _peer_generation_config(model, options["temperature"], longest_out)
        gen_config.min_new_tokens = None   # per-request lengths; EOS is disabled per request
        init_kwargs, applied = _cb_init_kwargs(model, gen_config, payload, options)
        progress.update(force=True, phase="setup", load_s=result.load_s)
        setup_start = time.perf_counter()
        manager = model.init_continuous_batching(**init_kwargs)
        # What the manager switched the model to (restored by stop()).
        attn = model.config._attn_implementation
        progress.update(force=True, attn_implementation=attn)
        if hasattr(manager, "warmup"):
            manager.warmup()
        manager.start()
        result.load_s += time.perf_counter() - setup_start
        resolved = getattr(manager, "continuous_batching_config", None)
        settings = {key: getattr(resolved, key, None) for key in (
            "num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph",
            "use_async_batching")} if resolved is not None else {}

        progress.update(force=True, phase="generating", load_s=result.load_s, elapsed_s=0.0,
                        finished_requests=0, output_tokens=0, total_requests=len(payload))
        start = time.perf_counter()
        ids = [manager.add_request(input_ids=list(prompt), max_new_tokens=out_len,
                                   eos_token_id=-1)
               for prompt, out_len in payload]
        if any(rid is None for rid in ids):
            raise RuntimeError("the continuous batching manager dropped requests")
        wanted = dict(zip(ids, (out_len for _, out_len in payload)))
        finished: dict[str, Any] = {}
        tokens = 0
        while len(finished) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped unexpectedly")
                progress.update()  # writes a finish the rate limit held back
                continue
            if out.is_finished():
                if getattr(out, "error", None) is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                finished[out.request_id] = out
                tokens += len(out.generated_tokens)
                progress.update(elapsed_s=time.perf_counter() - start,
                                finished_requests=len(finished), output_tokens=tokens)
        result.elapsed_s = time.perf_counter() - start
        made = {rid: len(out.generated_tokens) for rid, out in finished.items()}
        short = {rid: (made[rid], wanted[rid]) for rid in made if made[rid] != wanted[rid]}
        if short:
            raise RuntimeError(f"{len(short)} requests did not get their requested length, "
                               f"e.g. {next(iter(short.items()))}")
        result.num_requests = len(payload)
        result.prompt_tokens = sum(len(prompt) for prompt, _ in payload)
        result.output_tokens = result.generated_tokens = sum(made.values())
        result.extra = {"attn_implementation": attn, "device": str(model.device),
                        "requested": applied, "resolved": _jsonable(settings)}
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if manager is not None:
            try:
                manager.stop(block=True, timeout=10)
            except Exception:
                pass
    result.peak_rss_bytes = peak_rss_bytes()
    result.memory_note = "VmHWM of the peer's own spawned process"
    return asdict(result)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ------------------------------------------------------------------------------------------
# The latency peer (`folio bench latency --peer transformers`)
# ------------------------------------------------------------------------------------------

# What the latency bench ran, in order: (kind, max_tokens, prompts). Kinds: "warmup" and
# "timed" (output_len tokens), "prefill_warmup" and "prefill" (1 token).
LatencySchedule = list[tuple[str, int, list[list[int]]]]
_LATENCY_KEYS = {"warmup": "warmup_latencies", "timed": "latencies",
                 "prefill_warmup": "prefill_warmup_latencies", "prefill": "prefill_latencies"}


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
            return in_child(_transformers_latency_peer, model_source["path"], dtype or "float32",
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


def _transformers_latency_peer(model_dir: str, dtype_name: str, device: str,
                               schedule: LatencySchedule, progress_path: str | None = None
                               ) -> dict[str, Any]:
    """Each schedule entry is one timed `generate` of its prompts (one equal-length batch, so
    no padding) for exactly max_tokens new tokens: greedy, static KV cache, no torch.compile,
    EOS disabled (the equivalent of ignore_eos). At least one untimed warm-up runs first."""
    import torch
    from transformers import GenerationConfig
    out: dict[str, Any] = {"engine": "transformers", "error": None, "load_s": 0.0,
                           **{key: [] for key in _LATENCY_KEYS.values()}}
    progress = _Progress(progress_path)
    try:
        progress.update(force=True, phase="loading")
        result = EngineResult(engine="transformers")
        model = _load_peer_model(model_dir, dtype_name, device, result, attn_implementation="sdpa")
        out["load_s"] = result.load_s
        out["baseline_rss_bytes"] = result.baseline_rss_bytes
        # No EOS at all: None in the call's config is filled from model.generation_config, so
        # clear it there too. min_new_tokens stays as a backstop (it only acts with an EOS).
        model.generation_config.eos_token_id = None
        pad = _pad_id(model)

        def generate(prompts: list[list[int]], max_tokens: int) -> float:
            input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
            config = GenerationConfig(
                do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                eos_token_id=None, pad_token_id=pad, cache_implementation="static",
                disable_compile=True)
            _synchronize(device)
            start = time.perf_counter()
            sequences = model.generate(input_ids=input_ids,
                                       attention_mask=torch.ones_like(input_ids),
                                       generation_config=config)
            _synchronize(device)
            elapsed = time.perf_counter() - start
            made = sequences.shape[1] - input_ids.shape[1]
            if made != max_tokens:
                raise RuntimeError(f"generate made {made} tokens per row, expected {max_tokens}")
            return elapsed

        progress.update(force=True, phase="running", load_s=out["load_s"], calls_done=0)
        if not any(kind == "warmup" for kind, _, _ in schedule) and schedule:
            _, max_tokens, prompts = next((e for e in schedule if e[0] == "timed"), schedule[0])
            out["warmup_latencies"].append(generate(prompts, max_tokens))
        for done, (kind, max_tokens, prompts) in enumerate(schedule, 1):
            out[_LATENCY_KEYS[kind]].append(generate(prompts, max_tokens))
            progress.update(calls_done=done)
        out["attn_implementation"] = model.config._attn_implementation
        out["cache_implementation"] = "static"
        out["torch_compile"] = False
        out["device"] = str(model.device)
        out["dtype"] = dtype_name
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out
