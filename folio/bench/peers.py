"""The peers of `folio bench throughput`: transformers on the same requests and weights.

Peers run the *same* requests on the *same* weights and dtype, each in its own spawned process,
so its peak RSS (VmHWM of that process) is its own and not mixed with folio's:

* ``transformers``: `model.generate` in static, left-padded batches of ``--peer-batch-size``
  requests, each batch generating ``max(output_len)`` tokens for every row. The padding waste
  is part of the peer's real cost, but only the tokens each request asked for count as output.
* ``transformers-cb``: transformers' own continuous batching (`init_continuous_batching`,
  paged KV cache, per-request max_new_tokens), when this transformers version offers it.

The functions handed to the spawned child (`_transformers_static_peer`, `_transformers_cb_peer`)
are top-level functions of this module, so the child can import them by name.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any, Callable

from folio.bench.datasets import SampleRequest
from folio.bench.results import EngineResult, current_rss_bytes, peak_rss_bytes

PEERS = ("none", "transformers", "transformers-cb")


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
    print(f"running peer {peer} on {len(payload)} requests ...", flush=True)
    try:
        out = in_child(worker, source["path"], info["dtype"] or "float32", payload,
                       args.peer_batch_size, args.temperature, args.seed)
    except Exception as exc:  # the child died (out of memory...) or could not start
        return EngineResult(engine=peer, error=f"{type(exc).__name__}: {exc}")
    return EngineResult(**out)


def in_child(fn: Callable[..., Any], *fn_args: Any) -> Any:
    """Run fn(*fn_args) in a fresh spawned process: its peak RSS is then its own, and a crash
    or leak there cannot disturb the benchmark process."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()


# ------------------------------------------------------------------------------------------
# Peers (each runs inside a spawned child)
# ------------------------------------------------------------------------------------------

def _load_peer_model(model_dir: str, dtype_name: str, result: EngineResult) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    result.baseline_rss_bytes = current_rss_bytes()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    model.eval()
    result.load_s = time.perf_counter() - start
    return model


def _peer_generation_config(model: Any, temperature: float, max_new_tokens: int) -> Any:
    """The folio requests' sampling (temperature, top_p=1, no top-k), built from scratch so a
    generation_config.json in the directory cannot add processors folio does not run."""
    from transformers import GenerationConfig
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id
    sample = temperature > 0
    return GenerationConfig(
        do_sample=sample, temperature=temperature if sample else None,
        top_p=1.0 if sample else None, top_k=0 if sample else None,
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        pad_token_id=int(pad if pad is not None else (eos if isinstance(eos, int) else 0)),
        eos_token_id=eos)


def _transformers_static_peer(model_dir: str, dtype_name: str,
                              payload: list[tuple[list[int], int]], batch_size: int,
                              temperature: float, seed: int) -> dict:
    """HF `generate` in static batches of `batch_size` requests, in request order, left-padded;
    each batch runs to its longest requested output (min_new_tokens = max_new_tokens, so EOS
    cannot end a row early: the equivalent of ignore_eos)."""
    import torch
    result = EngineResult(engine="transformers")
    try:
        torch.manual_seed(seed)
        model = _load_peer_model(model_dir, dtype_name, result)
        gen_pad = _peer_generation_config(model, temperature, 1).pad_token_id
        useful = generated = prompt_tokens = 0
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
                out = model.generate(input_ids=input_ids, attention_mask=mask,
                                     generation_config=_peer_generation_config(
                                         model, temperature, steps))
                made = out.shape[1] - width
                if made != steps:
                    raise RuntimeError(f"generate made {made} tokens per row, expected {steps}")
                generated += made * len(batch)
                useful += sum(out_len for _, out_len in batch)
                prompt_tokens += sum(len(ids) for ids, _ in batch)
        result.elapsed_s = time.perf_counter() - start
        result.num_requests = len(payload)
        result.prompt_tokens = prompt_tokens
        result.output_tokens = useful
        result.generated_tokens = generated
        result.extra = {"batch_size": batch_size, "padding_waste_tokens": generated - useful,
                        "attn_implementation": model.config._attn_implementation}
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.peak_rss_bytes = peak_rss_bytes()
    result.memory_note = "VmHWM of the peer's own spawned process"
    return asdict(result)


def _transformers_cb_peer(model_dir: str, dtype_name: str,
                          payload: list[tuple[list[int], int]], batch_size: int,
                          temperature: float, seed: int) -> dict:
    """transformers' continuous batching: every request queued at once with its own
    max_new_tokens and EOS disabled (-1), like folio's ignore_eos. The manager's set-up and
    warm-up are counted in load_s, as folio's start-up is."""
    import torch
    result = EngineResult(engine="transformers-cb")
    manager = None
    try:
        from transformers import GenerationMixin
        if not hasattr(GenerationMixin, "init_continuous_batching"):
            raise RuntimeError("this transformers version has no continuous batching API")
        torch.manual_seed(seed)
        model = _load_peer_model(model_dir, dtype_name, result)
        longest_out = max(out_len for _, out_len in payload)
        gen_config = _peer_generation_config(model, temperature, longest_out)
        gen_config.min_new_tokens = None   # per-request lengths; EOS is disabled per request
        hints = None
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            hints = WorkloadHints(max_prompt_length=max(len(ids) for ids, _ in payload),
                                  max_generated_length=longest_out, num_requests=len(payload))
        except Exception:
            hints = None  # an older API without hints: the manager picks its own sizes
        setup_start = time.perf_counter()
        manager = model.init_continuous_batching(generation_config=gen_config,
                                                 workload_hints=hints)
        if hasattr(manager, "warmup"):
            manager.warmup()
        manager.start()
        result.load_s += time.perf_counter() - setup_start

        start = time.perf_counter()
        ids = [manager.add_request(input_ids=list(prompt), max_new_tokens=out_len,
                                   eos_token_id=-1)
               for prompt, out_len in payload]
        wanted = dict(zip(ids, (out_len for _, out_len in payload)))
        finished: dict[str, Any] = {}
        while len(finished) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped unexpectedly")
                continue
            if out.is_finished():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                finished[out.request_id] = out
        result.elapsed_s = time.perf_counter() - start
        made = {rid: len(out.generated_tokens) for rid, out in finished.items()}
        short = {rid: (made[rid], wanted[rid]) for rid in made if made[rid] != wanted[rid]}
        if short:
            raise RuntimeError(f"{len(short)} requests did not get their requested length, "
                               f"e.g. {next(iter(short.items()))}")
        result.num_requests = len(payload)
        result.prompt_tokens = sum(len(prompt) for prompt, _ in payload)
        result.output_tokens = result.generated_tokens = sum(made.values())
        result.extra = {"attn_implementation": model.config._attn_implementation}
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

