"""`folio bench latency`: end-to-end latency of one batch, and decode time per token.

vLLM's `bench latency` semantics: every iteration is one `LLM.generate` of `--batch-size`
requests of `--input-len` random prompt tokens, each generating exactly `--output-len` tokens
(greedy, ignore_eos); after `--num-iters-warmup` untimed iterations, `--num-iters` are timed
and the median / p90 latency reported. On top of vLLM, the same batch is also run with
max_tokens=1 (prefill plus the first token), so the decode time per output token is
(latency − prefill latency) / (output_len − 1), free of TTFT; it is compared with the
memory-bandwidth floor of `folio.bench.roofline`. Unlike vLLM, each iteration draws fresh
prompts (same lengths), so default-on prefix caching cannot turn prefills into cache hits.

Start-to-ready (constructing `LLM(...)` until it returns) is reported with the worker's split
(model load, KV profiling, KV allocation, CUDA graph capture). ``--peer transformers`` replays
exactly the calls timed above (same prompts, same order, same token counts) through
transformers' `generate` with a static KV cache (greedy, EOS off, no torch.compile) on the same
weights, dtype and device, in a child process, and reports the same statistics and the
folio/peer time ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from folio.bench.command import bench_main
from folio.bench import roofline
from folio.bench.datasets import special_token_ids
from folio.bench.lora_adapters import (add_lora_bench_args, lora_engine_kwargs, spread,
                                       write_random_adapters)
from folio.bench.plot_support import add_plot_arg
from folio.bench.spec_report import format_spec_report, spec_counts, spec_report
from folio.bench.peers import (add_peer_timeout_arg, describe_free_memory, peer_timeout,
                               release_device_memory, run_latency_peer,
                               run_llama_cpp_latency_peer)
from folio.bench.random_model import (RANDOM_CONFIGS, RANDOM_QUANTIZATIONS,
                                      build_random_model_in_child)
from folio.bench.startup_report import format_startup, startup_breakdown

__all__ = ["LATENCY_PEERS", "add_cli_args", "main", "run"]

LATENCY_PEERS = ("none", "transformers", "llama.cpp")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (shared with `folio chat` / `bench throughput`) plus vLLM's latency flags."""
    from folio.engine.arg_utils import add_engine_args
    add_engine_args(parser, model_positional=False)
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=["random", "editing"], default="random",
                       help="random: --input-len random token ids per prompt; editing: a "
                            "standard-library source file of about --input-len tokens to "
                            "rewrite with one name changed (folio/bench/editing.py), a "
                            "different file per prompt")
    group.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    group.add_argument("--batch-size", type=int, default=1, help="requests per iteration")
    group.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    group.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    group.add_argument("--step-breakdown", action="store_true",
                       help="after the timed runs, one more batch with each engine step's host "
                            "time split into schedule / launch / wait / update / output")
    group.add_argument("--no-roofline", action="store_true",
                       help="skip measuring copy bandwidth and the roofline comparison")
    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", choices=LATENCY_PEERS, default="none",
                      help="also time transformers' generate (static KV cache, greedy, no "
                           "torch.compile) on the same prompts, weights, dtype and device; or "
                           "llama.cpp (llama-cpp-python built by tools/build_llama_cpp.sh) on "
                           "the same GGUF file with as many threads")
    add_peer_timeout_arg(peer)
    random_group = parser.add_argument_group("random weights")
    random_group.add_argument("--random-weights", action="store_true",
                              help="benchmark a model with random weights and the shapes of --config")
    random_group.add_argument("--config", choices=sorted(RANDOM_CONFIGS), default=None,
                              help="the shapes for --random-weights")
    random_group.add_argument("--random-num-layers", type=int, default=None, help=argparse.SUPPRESS)
    random_group.add_argument("--random-quantization", choices=list(RANDOM_QUANTIZATIONS),
                              default=None,
                              help="store the random projections quantized: w4a16 = random "
                                   "4-bit codes in compressed-tensors' pack-quantized layout "
                                   "(group 128); for FP8 give --quantization fp8 instead")
    add_lora_bench_args(parser)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    add_plot_arg(parser, "each timed iteration's latency and the prefill/decode split")


def _validate(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if args.random_weights and args.config is None:
        raise ValueError(f"--random-weights needs --config NAME (one of {sorted(RANDOM_CONFIGS)})")
    if args.config is not None and not args.random_weights:
        raise ValueError("--config only applies with --random-weights")
    if args.random_weights and (getattr(args, "model_flag", None) or getattr(args, "model", None)):
        raise ValueError("--random-weights builds its own model; do not also give --model")
    peer_timeout(args)  # raises on a bad --peer-timeout


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`, print a summary and return the results."""
    from folio import LLM, SamplingParams
    from folio.engine.arg_utils import engine_kwargs_from_args

    _validate(args)
    kwargs = engine_kwargs_from_args(args)
    random_model = None
    if args.random_weights:
        # In a child process, as throughput does: the builder's peak memory stays out of ours.
        random_model = build_random_model_in_child(args.config, args.random_num_layers,
                                                   args.random_quantization)
        kwargs["model"] = random_model["path"]
    lora_engine_kwargs(args, kwargs)
    early_bandwidth = None if args.no_roofline else \
        roofline.copy_bandwidth_before_engine(kwargs)

    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - start
    engine = llm.llm_engine
    adapters = write_random_adapters(engine.model_info.hf_config, args.lora, args.lora_rank,
                                     seed=args.seed) if args.lora else []
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"input-len + output-len = {args.input_len + args.output_len} exceeds "
                         f"max_model_len {engine.max_model_len}")
    vocab_size = engine.model_info.vocab_size
    excluded = np.fromiter(special_token_ids(llm.get_tokenizer()), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
    rng = np.random.default_rng(args.seed)
    # Every call below, in order, with its prompts: what --peer replays.
    schedule: list[tuple[str, int, list[list[int]]]] = []

    files_used = [0]

    def fresh_batch() -> list[dict[str, list[int]]]:
        # New prompts for every call: prefix caching is on by default, and re-sending one
        # fixed batch (as vLLM does) would turn every prefill after the first into a cache
        # hit, understating latency and the prefill time subtracted below.
        if args.dataset == "editing":
            from folio.bench.editing import editing_prompts
            tokenizer = llm.get_tokenizer()
            texts = editing_prompts(tokenizer, args.batch_size, args.input_len,
                                    start=files_used[0])
            files_used[0] += args.batch_size
            return [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]
        return [{"prompt_token_ids": rng.choice(allowed, size=args.input_len).tolist()}
                for _ in range(args.batch_size)]

    def timed(kind: str, max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        prompts = fresh_batch()  # drawn before the timer starts
        schedule.append((kind, max_tokens, [p["prompt_token_ids"] for p in prompts]))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False,
                               lora_request=spread(adapters, len(prompts)))
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    for _ in range(args.num_iters_warmup):
        timed("warmup", args.output_len)
    latencies, output_tokens = [], []
    spec_before = spec_counts(engine)
    for _ in range(args.num_iters):
        elapsed, n = timed("timed", args.output_len)
        latencies.append(elapsed)
        output_tokens.append(n)
    spec = spec_report(spec_before, spec_counts(engine))
    # Prefill-only runs (max_tokens=1): same count, so the medians are comparable. One warm-up
    # because a 1-token request can hit shapes (no decode) the full runs did not compile.
    timed("prefill_warmup", 1)
    prefill = [timed("prefill", 1)[0] for _ in range(args.num_iters)]

    stats = _latency_stats(latencies, prefill, args.output_len)
    breakdown = _step_breakdown(engine, fresh_batch(), args.output_len) \
        if args.step_breakdown else None
    per_token_s = stats["per_token_s"]
    executor = getattr(engine.engine_core, "executor", None)
    worker = getattr(executor, "worker", None)
    device = getattr(worker, "device", None)
    dtype = getattr(worker, "dtype", None)
    dtype_name = str(dtype).replace("torch.", "") if dtype is not None else None
    model_source = {"kind": engine.model_source.kind, "path": engine.model_source.path}
    model_path = model_source["path"]
    from folio.model.discovery import gguf_file_of
    gguf_path = gguf_file_of(engine.model_source)
    cache_dtype = getattr(worker, "kv_cache_dtype", None)

    report: dict[str, Any] = {
        # vLLM's bench latency keys.
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): _percentile(latencies, p) for p in (10, 25, 50, 75, 90, 99)},
        # folio's additions.
        "median_latency_s": stats["median_latency_s"],
        "p90_latency_s": stats["p90_latency_s"],
        "prefill_latencies": prefill,
        "median_prefill_latency_s": stats["median_prefill_latency_s"],
        "median_decode_ms_per_token": stats["median_decode_ms_per_token"],
        "decode_tokens_per_s_per_seq": stats["decode_tokens_per_s_per_seq"],
        "output_tokens_per_iter": output_tokens,
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "lora_adapters": args.lora, "lora_rank": args.lora_rank if args.lora else None,
        "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
        "model": model_source,
        "dtype": dtype_name,
        "device": str(device) if device is not None else None,
        # what the engine resolved (a checkpoint's own method; the cache's dtype under "auto")
        "quantization": getattr(worker, "quantization", None),
        "kv_cache_dtype": (str(cache_dtype).replace("torch.", "")
                           if cache_dtype is not None else None),
        # the engine arguments as given, as throughput's report has them
        "settings": {"engine": dict(kwargs)},
        "startup": startup_breakdown(startup_s, getattr(executor, "timings", None)),
        "random_model": random_model,
        "step_breakdown": breakdown,
        "dataset": args.dataset,
        "spec_decode": spec,
        "roofline": None,
        "prefill_roofline": None,
        "peer": None,
        "folio_over_peer": None,
    }
    if per_token_s is not None and per_token_s <= 0:
        print("warning: decode time per token came out <= 0 (prefill noise dominates); "
              "raise --output-len or --num-iters", file=sys.stderr)
    from folio.bench.quant_bytes import packed_weight_bytes
    stored_bytes = packed_weight_bytes(worker)
    del llm, engine, executor, worker
    # Free the engine's memory (on a GPU: back to the driver) before the bandwidth probe
    # allocates its buffers and before the peer's process loads its own copy of the model.
    release_device_memory()

    if not args.no_roofline and per_token_s and per_token_s > 0 and device is not None:
        report["roofline"] = _roofline(args, model_path, device, dtype, per_token_s,
                                       early_bandwidth, stored_bytes, cache_dtype)
    if not args.no_roofline and device is not None:
        report["prefill_roofline"] = _prefill_roofline(args, model_path, device,
                                                       stats["median_prefill_latency_s"])

    if args.peer != "none":
        free = describe_free_memory(release_device_memory())
        if free:
            print(free, flush=True)
        report["peer"] = _run_peer(args, model_source, dtype_name, report["device"], schedule,
                                   gguf_path)
        report["folio_over_peer"] = _ratios(report, report["peer"])

    _print_summary(report)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if getattr(args, "plot", None):
        from folio.bench.latency_plot import plot_latency
        print(f"plot written to {plot_latency(report, args.plot)}")
    return report


def _step_breakdown(engine: Any, prompts: list[dict[str, list[int]]],
                    output_len: int) -> dict[str, Any]:
    """One batch stepped by hand, the engine core timing its parts (EngineCore.step_times):
    ms per engine step in the scheduler, the executor's launch, the wait for sampled ids, the
    scheduler's update, and the rest of `LLMEngine.step` (output processing)."""
    from folio import SamplingParams
    from folio.engine.engine_core import StepTimes
    core = engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"breakdown-{i}", prompt, params)
    times = core.step_times = StepTimes()
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        core.step_times = None
    total = time.perf_counter() - start
    steps = max(times.steps, 1)
    parts = {"schedule": times.schedule_s, "launch": times.launch_s, "wait": times.wait_s,
             "update": times.update_s}
    parts["output"] = total - sum(parts.values())
    ms = {name: 1e3 * value / steps for name, value in parts.items()}
    return {"steps": times.steps, "ms_per_step": 1e3 * total / steps, "parts_ms": ms,
            "line": f"step breakdown ({times.steps} steps): {1e3 * total / steps:.3f} ms/step = "
                    + " + ".join(f"{name} {value:.3f}" for name, value in ms.items())}


def _latency_stats(latencies: list[float], prefill: list[float],
                   output_len: int) -> dict[str, Any]:
    """Median latency, median prefill (max_tokens=1: the TTFT of the batch) and decode time per
    output token, (median latency - median prefill) / (output_len - 1)."""
    median_latency = _median(latencies)
    median_prefill = _median(prefill)
    per_token_s = ((median_latency - median_prefill) / (output_len - 1)
                   if output_len > 1 else None)
    return {"median_latency_s": median_latency, "p90_latency_s": _percentile(latencies, 90),
            "median_prefill_latency_s": median_prefill, "per_token_s": per_token_s,
            "median_decode_ms_per_token": per_token_s * 1e3 if per_token_s is not None else None,
            "decode_tokens_per_s_per_seq": (1.0 / per_token_s) if per_token_s and per_token_s > 0
            else None}


def _run_peer(args: argparse.Namespace, model_source: dict[str, str], dtype: str | None,
              device: str | None, schedule: list[tuple[str, int, list[list[int]]]],
              gguf_path: str | None) -> dict[str, Any]:
    if args.peer == "llama.cpp":
        import torch
        n_ctx = args.input_len + args.output_len + 16
        peer = run_llama_cpp_latency_peer(gguf_path, torch.get_num_threads(), n_ctx, schedule,
                                          peer_timeout(args))
    else:
        peer = run_latency_peer(model_source, dtype, device, schedule, peer_timeout(args))
    if peer.get("error") is None:
        stats = _latency_stats(peer["latencies"], peer["prefill_latencies"], args.output_len)
        stats.pop("per_token_s")
        peer.update(stats)
    return peer


def _ratios(report: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None] | None:
    """folio's time over the peer's (below 1: folio is faster)."""
    if peer.get("error") is not None:
        return None

    def ratio(key: str) -> float | None:
        mine, theirs = report.get(key), peer.get(key)
        return mine / theirs if mine and theirs and mine > 0 and theirs > 0 else None

    return {"decode_ms_per_token": ratio("median_decode_ms_per_token"),
            "ttft": ratio("median_prefill_latency_s"), "latency": ratio("median_latency_s")}


def _median(values: list[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _roofline(args: argparse.Namespace, model_path: str, device: Any, dtype: Any,
              per_token_s: float, early_bandwidth: float | None = None,
              stored_weight_bytes: int | None = None,
              cache_dtype: Any = None) -> dict[str, Any]:
    from folio.bench import quant_bytes
    dtype_bytes = int(getattr(dtype, "itemsize", 2))
    bits = quant_bytes.projection_bits(model_path, getattr(args, "quantization", None))
    # the cache's own dtype where the engine chose it ("auto" for a GGUF model on the CPU
    # is float16), else what the flag names
    kv_bytes = int(getattr(cache_dtype, "itemsize", 0)) or quant_bytes.kv_dtype_bytes(
        getattr(args, "kv_cache_dtype", None), dtype_bytes)
    # Decode steps see contexts from input_len + 1 to input_len + output_len - 1; bytes are
    # linear in the context, so the mean step reads the KV of the midpoint context.
    context = args.input_len + args.output_len // 2
    step_bytes = roofline.decode_bytes_per_step(model_path, args.batch_size, context, dtype_bytes,
                                                projection_bits=bits, kv_dtype_bytes=kv_bytes,
                                                stored_weight_bytes=stored_weight_bytes)
    bandwidth = roofline.best_copy_bandwidth(device, early_bandwidth)
    floor_s = step_bytes / bandwidth  # one step yields one token for every sequence
    cache = roofline.last_level_cache_bytes() if str(device).startswith("cpu") else None
    return {"bytes_per_step": step_bytes, "context_len": context, "dtype_bytes": dtype_bytes,
            "projection_bits": bits, "kv_dtype_bytes": kv_bytes,
            "stored_weight_bytes": stored_weight_bytes, "last_level_cache_bytes": cache,
            "bandwidth_bytes_per_s": bandwidth, "floor_ms_per_token": floor_s * 1e3,
            "fraction_of_roofline": floor_s / per_token_s,
            "line": roofline.roofline_line(floor_s, bandwidth, per_token_s, step_bytes, cache)}


def _prefill_roofline(args: argparse.Namespace, model_path: str, device: Any,
                      ttft_s: float) -> dict[str, Any]:
    """TTFT against the compute roof: the prefill's FLOPs over the dense-matmul FLOP/s the
    same device reaches (bf16 n=8192 on a GPU), measured here rather than taken from a sheet."""
    flops = roofline.prefill_flops(model_path, args.batch_size, args.input_len)
    peak = roofline.matmul_peak_flops(device)
    achieved = flops / ttft_s if ttft_s > 0 else 0.0
    return {"flops": flops, "achieved_flops_per_s": achieved, "matmul_peak_flops_per_s": peak,
            "fraction_of_peak": achieved / peak if peak > 0 else 0.0,
            "line": (f"prefill: {flops / 1e12:.2f} TFLOP in {ttft_s * 1e3:.2f} ms = "
                     f"{achieved / 1e12:.1f} TFLOP/s, {100 * achieved / peak:.1f}% of the "
                     f"measured matmul peak {peak / 1e12:.1f} TFLOP/s")}


def _print_summary(report: dict[str, Any]) -> None:
    print()
    random_model = report.get("random_model")
    if random_model:
        how = (f"built in {random_model['build_s']:.1f} s on {random_model['generator']}"
               if random_model["built"] else "cached")
        print(f"random-weights model: {how} (not part of start-to-ready)")
    print(format_startup(report["startup"]))
    print(f"model: {report['model']['path']} ({report['dtype']}, {report['device']}); "
          f"batch {report['batch_size']}, input {report['input_len']}, "
          f"output {report['output_len']}, {report['num_iters']} iterations")
    print(f"latency: median {report['median_latency_s'] * 1e3:.2f} ms, "
          f"p90 {report['p90_latency_s'] * 1e3:.2f} ms, avg {report['avg_latency'] * 1e3:.2f} ms")
    print(f"prefill (max_tokens=1, TTFT): median {report['median_prefill_latency_s'] * 1e3:.2f} ms")
    if report["median_decode_ms_per_token"] is not None:
        rate = report["decode_tokens_per_s_per_seq"]
        print(f"decode: median {report['median_decode_ms_per_token']:.3f} ms/token, "
              f"{rate:.1f} tokens/s per sequence" if rate else
              f"decode: median {report['median_decode_ms_per_token']:.3f} ms/token")
    if report.get("spec_decode"):
        print(format_spec_report(report["spec_decode"]))
    if report.get("step_breakdown"):
        print(report["step_breakdown"]["line"])
    if report["roofline"]:
        print(report["roofline"]["line"])
    if report.get("prefill_roofline"):
        print(report["prefill_roofline"]["line"])
    peer = report.get("peer")
    if peer:
        _print_peer(peer, report.get("folio_over_peer"))


def _print_peer(peer: dict[str, Any], ratios: dict[str, float | None] | None) -> None:
    name = f"peer {peer['engine']}" + (" (static KV cache, no torch.compile)"
                                       if peer["engine"] == "transformers" else "")
    if peer.get("error") is not None:
        print(f"{name}: {peer['error']}")
        return
    print(f"{name}: {peer.get('attn_implementation')}, {peer.get('device')}, "
          f"{peer.get('dtype')}; load {peer['load_s']:.1f} s")
    print(f"  latency: median {peer['median_latency_s'] * 1e3:.2f} ms; prefill (TTFT): median "
          f"{peer['median_prefill_latency_s'] * 1e3:.2f} ms")
    if peer.get("median_decode_ms_per_token") is not None:
        print(f"  decode: median {peer['median_decode_ms_per_token']:.3f} ms/token")
    if ratios:
        parts = [f"{label} {ratios[key]:.2f}x" for key, label in (
            ("decode_ms_per_token", "decode ms/token"), ("ttft", "TTFT"), ("latency", "latency"))
            if ratios.get(key)]
        if parts:
            print(f"folio/peer time ratio (below 1: folio faster): {', '.join(parts)}")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, 'folio bench latency',
                      'Latency of one batch; decode time per token.',
                      add_cli_args, run)


if __name__ == "__main__":
    sys.exit(main())
