"""The transformers peers' bodies: each runs inside a spawned child (folio.bench.peers starts
them), on the requests, weights, dtype and device folio's run used.

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

The throughput peers write their progress (`Progress`) as they go, so a killed peer still
reports what it had finished. The functions handed to the child (`transformers_static_peer`,
`transformers_cb_peer`, `transformers_latency_peer`) are top-level functions of this module, so
the child can import them by name; torch and transformers are imported inside them, so the
benchmark process that only starts them does not load transformers for them.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

from folio.bench.child_process import Progress
from folio.bench.results import EngineResult, current_rss_bytes, peak_rss_bytes

# What the latency bench ran, in order: (kind, max_tokens, prompts). Kinds: "warmup" and
# "timed" (output_len tokens), "prefill_warmup" and "prefill" (1 token).
LatencySchedule = list[tuple[str, int, list[list[int]]]]
_LATENCY_KEYS = {"warmup": "warmup_latencies", "timed": "latencies",
                 "prefill_warmup": "prefill_warmup_latencies", "prefill": "prefill_latencies"}


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


def transformers_static_peer(model_dir: str, dtype_name: str, device: str,
                             payload: list[tuple[list[int], int]], options: dict[str, Any],
                             progress_path: str | None = None) -> dict:
    """HF `generate` in static batches of options["batch_size"] requests, in request order,
    left-padded; each batch runs to its longest requested output (min_new_tokens =
    max_new_tokens, so EOS cannot end a row early: the equivalent of ignore_eos)."""
    import torch
    result = EngineResult(engine="transformers")
    progress = Progress(progress_path)
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


def transformers_cb_peer(model_dir: str, dtype_name: str, device: str,
                         payload: list[tuple[list[int], int]], options: dict[str, Any],
                         progress_path: str | None = None) -> dict:
    """transformers' continuous batching with paged sdpa attention: every request queued at once
    with its own max_new_tokens and EOS disabled (-1), like folio's ignore_eos. The manager's
    set-up and warm-up are counted in load_s, as folio's start-up is."""
    import torch
    result = EngineResult(engine="transformers-cb")
    progress = Progress(progress_path)
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


def latency_result(engine: str) -> dict[str, Any]:
    """A latency peer's result before it runs: no error, no load time, empty time lists."""
    return {"engine": engine, "error": None, "load_s": 0.0,
            **{key: [] for key in _LATENCY_KEYS.values()}}


def replay_latency_schedule(schedule: LatencySchedule,
                            call: Callable[[list[list[int]], int], float],
                            out: dict[str, Any], progress: Progress) -> None:
    """Time `call(prompts, max_tokens)` for every schedule entry, in order, into out's lists
    (at least one untimed warm-up first), reporting progress as it goes."""
    progress.update(force=True, phase="running", load_s=out["load_s"], calls_done=0)
    if not any(kind == "warmup" for kind, _, _ in schedule) and schedule:
        _, max_tokens, prompts = next((e for e in schedule if e[0] == "timed"), schedule[0])
        out["warmup_latencies"].append(call(prompts, max_tokens))
    for done, (kind, max_tokens, prompts) in enumerate(schedule, 1):
        out[_LATENCY_KEYS[kind]].append(call(prompts, max_tokens))
        progress.update(calls_done=done)


def transformers_latency_peer(model_dir: str, dtype_name: str, device: str,
                              schedule: LatencySchedule, progress_path: str | None = None
                              ) -> dict[str, Any]:
    """Each schedule entry is one timed `generate` of its prompts (one equal-length batch, so
    no padding) for exactly max_tokens new tokens: greedy, static KV cache, no torch.compile,
    EOS disabled (the equivalent of ignore_eos). At least one untimed warm-up runs first."""
    import torch
    from transformers import GenerationConfig
    out = latency_result("transformers")
    progress = Progress(progress_path)
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

        replay_latency_schedule(schedule, generate, out, progress)
        out["attn_implementation"] = model.config._attn_implementation
        out["cache_implementation"] = "static"
        out["torch_compile"] = False
        out["device"] = str(model.device)
        out["dtype"] = dtype_name
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out
