"""`folio bench kv-tiers`: the TTFT of a request whose long prefix is (1) a device prefix hit,
(2) evicted from the device cache and found in the host tier (--kv-offloading-size), (3)
recomputed — the seed's measurement for vLLM's CPU offloading (a 1,600-token prefix: 14.0 ms
as a GPU hit, 35.1 ms from the CPU tier, 77.3 ms recomputed).

Each iteration: a fresh prefix of --input-len tokens (random ids) is prefilled once; a
request of prefix + a short suffix is timed (max_tokens 1) while the prefix is on the device;
filler prompts then push it out of the device cache (into the host tier); the same prefix +
another suffix is timed again (a host hit); the prefix cache is reset (device and host) and
a third suffix timed (recompute). The engine needs --kv-offloading-size and a device cache
small enough for the fillers to evict the prefix (--num-gpu-blocks-override).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from folio.engine.arg_utils import add_engine_args
    add_engine_args(parser, model_positional=False)
    group = parser.add_argument_group("workload")
    group.add_argument("--input-len", type=int, default=1600, help="prefix tokens")
    group.add_argument("--suffix-len", type=int, default=16, help="new tokens after the prefix")
    group.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    group.add_argument("--num-iters-warmup", type=int, default=1)
    group.add_argument("--output-json", default=None)


def _ttft(llm: Any, ids: list[int]) -> float:
    from folio import SamplingParams
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1,
                                                           detokenize=False), use_tqdm=False)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    from folio import LLM
    from folio.engine.arg_utils import engine_kwargs_from_args
    kwargs = engine_kwargs_from_args(args)
    if kwargs.get("kv_offloading_size") is None:
        raise ValueError("bench kv-tiers measures the host tier: give --kv-offloading-size")
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core
    block = core.config.cache.block_size
    capacity = core.kv_capacity_tokens
    rng = np.random.default_rng(args.seed or 0)
    vocab = llm.llm_engine.model_info.vocab_size

    def tokens(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    # fillers: enough distinct prompts to cycle the whole device cache once more
    filler_len = min(args.input_len, llm.llm_engine.max_model_len - 2)
    num_fillers = capacity // filler_len + 2
    times: dict[str, list[float]] = {"device": [], "host": [], "recompute": []}
    host_hits = 0
    for it in range(args.num_iters_warmup + args.num_iters):
        prefix = tokens(args.input_len)
        _ttft(llm, prefix + tokens(args.suffix_len))                   # prefill the prefix
        device = _ttft(llm, prefix + tokens(args.suffix_len))
        for _ in range(num_fillers):
            _ttft(llm, tokens(filler_len))
        before = core.scheduler.stats().kv_offload_hit_blocks
        host = _ttft(llm, prefix + tokens(args.suffix_len))
        found = core.scheduler.stats().kv_offload_hit_blocks - before
        if not llm.llm_engine.engine_core.reset_prefix_cache():
            raise RuntimeError("could not reset the prefix cache")
        recompute = _ttft(llm, prefix + tokens(args.suffix_len))
        if it >= args.num_iters_warmup:
            times["device"].append(device)
            times["host"].append(host)
            times["recompute"].append(recompute)
            host_hits += found
    expected = args.num_iters * (args.input_len // block)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    report = {
        "input_len": args.input_len, "suffix_len": args.suffix_len, "num_iters": args.num_iters,
        "median_ttft_ms": medians,
        "host_over_device": medians["host"] / medians["device"],
        "host_over_recompute": medians["host"] / medians["recompute"],
        "host_hit_blocks": host_hits, "host_hit_blocks_possible": expected,
    }
    print(f"TTFT of a {args.input_len}-token prefix + {args.suffix_len} (median of "
          f"{args.num_iters}): device hit {medians['device']:.2f} ms, host tier "
          f"{medians['host']:.2f} ms, recompute {medians['recompute']:.2f} ms; host / device "
          f"{report['host_over_device']:.2f}x, host / recompute "
          f"{report['host_over_recompute']:.2f}x; host hits {host_hits} of {expected} blocks")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    llm.llm_engine.shutdown()
    return report
