"""`folio bench throughput`: offline throughput on random-token requests, optionally against a peer.

vLLM's `bench throughput` semantics: every request is submitted at once to `LLM.generate`, and
throughput is measured around that call only (engine start-up is reported separately). The
default workload is nano-vllm's published one: 256 requests, prompt and output lengths uniform
in [100, 1024], random prompt tokens, temperature 1.0 and ignore_eos so every request generates
exactly the number of tokens it asked for. Start-to-ready (constructing `LLM(...)` until it
returns) is reported split into the worker's stages; a random-weights build is timed apart.

This module holds the CLI, the folio run and the report. The peers (``--peer transformers``,
``--peer transformers-cb``), which run the same requests on the same weights in their own
spawned processes, are started by `folio.bench.peers` (what they run:
`folio.bench.transformers_peers`); ``--random-weights --config NAME`` models are built by
`folio.bench.random_model`; `EngineResult` and the RSS helpers are in `folio.bench.results`;
the start-to-ready split is `folio.bench.startup_report`.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

from folio.bench.command import bench_main
from folio.bench.lora_adapters import (add_lora_bench_args, lora_engine_kwargs, spread,
                                       write_random_adapters)
from folio.bench.datasets import SampleRequest, sample_random_requests, special_token_ids
from folio.bench.embed_throughput import DEFAULT_PEER_BATCH_SIZES as DEFAULT_EMBED_PEER_BATCH_SIZES
from folio.bench.embed_throughput import PEER as EMBED_PEER
from folio.bench.embed_throughput import embed_passes
from folio.bench.plot_support import add_plot_arg
from folio.bench.peers import (DEFAULT_CB_MAX_BATCH_TOKENS, PEERS, add_peer_timeout_arg,
                               describe_free_memory, peer_timeout, release_device_memory,
                               run_peer)
from folio.bench.random_model import (RANDOM_CONFIGS, RANDOM_QUANTIZATIONS, build_random_model,
                                      build_random_model_in_child, random_model_dir)
from folio.bench.results import EngineResult, current_rss_bytes, peak_rss_bytes
from folio.bench.spec_report import format_spec_report, spec_counts, spec_report
from folio.bench.startup_report import format_startup, startup_breakdown

__all__ = ["PEERS", "RANDOM_CONFIGS", "EngineResult", "add_cli_args", "build_random_model", "main",
           "random_model_dir", "run"]


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM's names, shared with `folio chat`) plus the benchmark's own."""
    from folio.engine.arg_utils import add_engine_args
    add_engine_args(parser, model_positional=False)
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=256, help="number of requests")
    group.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024],
                       metavar=("LOW", "HIGH"), help="prompt length, uniform in [LOW, HIGH]")
    group.add_argument("--output-len-range", type=int, nargs=2, default=[100, 1024],
                       metavar=("LOW", "HIGH"), help="output length, uniform in [LOW, HIGH]")
    group.add_argument("--input-len", type=int, default=None,
                       help="vLLM's fixed prompt length: --input-len-range N N")
    group.add_argument("--output-len", type=int, default=None,
                       help="vLLM's fixed output length: --output-len-range N N")
    group.add_argument("--temperature", type=float, default=1.0,
                       help="sampling temperature of every request (nano-vllm's workload: 1.0)")
    group.add_argument("--disable-detokenize", action="store_true",
                       help="do not detokenize outputs (measures the model and scheduler only)")
    group.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", nargs="+", choices=PEERS + (EMBED_PEER,), default=["none"],
                      help="also run these engines on the same requests and weights "
                           "(e.g. --peer transformers transformers-cb; with --task embed: "
                           "--peer sentence-transformers)")
    peer.add_argument("--peer-batch-sizes", type=int, nargs="+",
                      default=list(DEFAULT_EMBED_PEER_BATCH_SIZES),
                      help="--task embed: the batch sizes sentence-transformers runs at (the "
                           "best is reported)")
    peer.add_argument("--embed-passes", type=int, default=3,
                      help="--task embed: timed passes over the texts, each side (the peer at "
                           "each batch size); the median pass is reported")
    peer.add_argument("--peer-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="--task embed: sentence-transformers' dtype (default: folio's)")
    peer.add_argument("--peer-batch-size", type=int, default=16,
                      help="static batch size of the transformers peer")
    peer.add_argument("--peer-cb-max-batch-tokens", type=int, default=DEFAULT_CB_MAX_BATCH_TOKENS,
                      help="max_batch_tokens (tokens per step) of the transformers-cb peer; its KV "
                           "cache is sized to hold the whole workload at once")
    add_peer_timeout_arg(peer)
    random_group = parser.add_argument_group("random weights")
    random_group.add_argument("--random-weights", action="store_true",
                              help="benchmark a model with random weights and the shapes of --config")
    random_group.add_argument("--config", choices=sorted(RANDOM_CONFIGS), default=None,
                              help="the shapes for --random-weights")
    # Test-only: a shallower model with otherwise real shapes, so creation can be smoke-tested.
    random_group.add_argument("--random-num-layers", type=int, default=None, help=argparse.SUPPRESS)
    random_group.add_argument("--random-quantization", choices=list(RANDOM_QUANTIZATIONS),
                              default=None,
                              help="store the random projections quantized: w4a16 = random "
                                   "4-bit codes in compressed-tensors' pack-quantized layout "
                                   "(group 128); for FP8 give --quantization fp8 instead")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring copy bandwidth and matmul peak and the roofline "
                             "comparison")
    add_lora_bench_args(parser)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    add_plot_arg(parser, "each engine's output tokens/s as bars (--task embed: sentences/s)")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from folio.engine.arg_utils import engine_kwargs_from_args
    kwargs = engine_kwargs_from_args(args)
    lora_engine_kwargs(args, kwargs)
    return kwargs


def _validate(args: argparse.Namespace) -> None:
    # vLLM's fixed lengths, as the ranges' one value (checked with them)
    if getattr(args, "input_len", None) is not None:
        args.input_len_range = [args.input_len, args.input_len]
    if getattr(args, "output_len", None) is not None:
        args.output_len_range = [args.output_len, args.output_len]
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be positive, got {args.num_prompts}")
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be positive, got {args.peer_batch_size}")
    if args.peer_cb_max_batch_tokens < 1:
        raise ValueError("--peer-cb-max-batch-tokens must be positive, got "
                         f"{args.peer_cb_max_batch_tokens}")
    peer_timeout(args)  # raises on a bad --peer-timeout
    if args.random_weights and args.config is None:
        raise ValueError("--random-weights needs --config NAME "
                         f"(one of {sorted(RANDOM_CONFIGS)})")
    if args.config is not None and not args.random_weights:
        raise ValueError("--config only applies with --random-weights")
    if args.random_weights and (getattr(args, "model_flag", None) or getattr(args, "model", None)):
        raise ValueError("--random-weights builds its own model; do not also give --model")
    if "none" in args.peer and len(args.peer) > 1:
        raise ValueError("--peer none cannot be combined with other peers")
    pooling = _is_pooling(_engine_kwargs(args))
    if (EMBED_PEER in args.peer) != pooling and args.peer != ["none"]:
        raise ValueError(f"--peer {EMBED_PEER} is the peer of --task embed; the other peers "
                         "generate")
    if any(size < 1 for size in args.peer_batch_sizes):
        raise ValueError("--peer-batch-sizes must be positive")
    embed_passes(args)  # raises on a bad --embed-passes


# ------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`, print a table and return the results."""
    _validate(args)
    kwargs = _engine_kwargs(args)
    random_model = None
    if args.random_weights:
        random_model = build_random_model_in_child(args.config, args.random_num_layers,
                                                   args.random_quantization)
        kwargs["model"] = random_model["path"]
    if _is_pooling(kwargs):
        from folio.bench.embed_throughput import run_embed
        report = run_embed(args, kwargs)
        report["random_model"] = random_model
        if args.output_json:
            with open(args.output_json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        _plot(args, report)
        return report

    from folio.bench import roofline
    early_bandwidth = None if args.no_roofline else \
        roofline.copy_bandwidth_before_engine(kwargs)
    folio_result, info = _run_folio(args, kwargs)
    info["random_model"] = random_model
    info["quantization"] = args.quantization
    info["kv_cache_dtype"] = args.kv_cache_dtype
    info["lora_adapters"] = args.lora
    info["lora_rank"] = args.lora_rank if args.lora else None
    requests: list[SampleRequest] = info.pop("requests")
    info["roofline"] = None if args.no_roofline else _roofline(info, requests, folio_result,
                                                               early_bandwidth)
    results = [folio_result]
    peers = [p for p in args.peer if p != "none"]
    if peers:
        # The peer gets the machine to itself: folio's engine was released in _run_folio, and
        # its GPU memory is handed back to the driver here.
        free = describe_free_memory(release_device_memory())
        if free:
            print(free, flush=True)
        for peer in peers:
            results.append(run_peer(peer, info, requests, args))

    report = _report(args, results, info)
    _print_table(results, info)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    _plot(args, report)
    return report


def _plot(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if getattr(args, "plot", None):
        from folio.bench.throughput_plot import plot_throughput
        print(f"plot written to {plot_throughput(report, args.plot)}")


def _is_pooling(kwargs: dict[str, Any]) -> bool:
    """`--task embed` (or `--runner pooling`): the embeddings benchmark, not generation."""
    from folio.pooling_params import TASK_ALIASES
    task = kwargs.get("task")
    runner = TASK_ALIASES[task][0] if task in TASK_ALIASES else kwargs.get("runner", "auto")
    return runner == "pooling"


def _run_folio(args: argparse.Namespace, kwargs: dict[str, Any]) -> tuple[EngineResult, dict]:
    from folio import LLM, SamplingParams

    result = EngineResult(engine="folio")
    result.baseline_rss_bytes = current_rss_bytes()
    start = time.perf_counter()
    llm = LLM(**kwargs)
    result.load_s = time.perf_counter() - start  # start-to-ready

    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    vocab_size = engine.model_info.vocab_size  # the model's (spec) vocab, not the tokenizer's
    requests = sample_random_requests(
        args.num_prompts, args.input_len_range, args.output_len_range, vocab_size,
        seed=args.seed, exclude_token_ids=special_token_ids(tokenizer))
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > engine.max_model_len:
        raise ValueError(f"the longest request needs {longest} tokens (prompt + output) but "
                         f"max_model_len is {engine.max_model_len}; shorten the ranges or raise "
                         "--max-model-len")

    detokenize = not args.disable_detokenize
    tokenizer_len = len(tokenizer) if tokenizer is not None else 0
    notes = []
    if detokenize and vocab_size > tokenizer_len:
        # Random-weights models borrow a smaller tokenizer: ids past its end cannot be decoded.
        detokenize = False
        notes.append(f"detokenization off: model vocab {vocab_size} > tokenizer's {tokenizer_len}")

    params = [SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True,
                             max_tokens=r.expected_output_len, detokenize=detokenize)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]

    adapters = write_random_adapters(engine.model_info.hf_config, args.lora, args.lora_rank,
                                     seed=args.seed) if args.lora else []
    spec_before = spec_counts(engine)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm,
                           lora_request=spread(adapters, len(prompts)))
    result.elapsed_s = time.perf_counter() - start
    spec = spec_report(spec_before, spec_counts(engine))
    result.peak_rss_bytes = peak_rss_bytes()
    result.memory_note = "VmHWM of the benchmark process (includes the KV cache as allocated)"

    result.num_requests = len(outputs)
    result.prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result.output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result.generated_tokens = result.output_tokens
    executor = getattr(engine.engine_core, "executor", None)
    worker = getattr(executor, "worker", None)
    dtype = getattr(worker, "dtype", None)
    from folio.bench.quant_bytes import packed_weight_bytes
    result.extra = {"spec_decode": spec,
                    "num_kv_blocks": getattr(engine.engine_core, "num_blocks", None),
                    "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                    "device": str(getattr(worker, "device", "")) or None,
                    "startup": startup_breakdown(result.load_s, getattr(executor, "timings", None)),
                    "detokenize": detokenize, "notes": notes}
    info = {
        "requests": requests,
        "model_source": {"kind": engine.model_source.kind, "path": engine.model_source.path},
        "dtype": result.extra["dtype"],
        "device": result.extra["device"],
        "vocab_size": vocab_size,
        "max_model_len": engine.max_model_len,
        "stored_weight_bytes": packed_weight_bytes(worker),
        "cache_dtype_bytes": int(getattr(getattr(worker, "kv_cache_dtype", None), "itemsize", 0)),
        # what the engine resolved (a checkpoint's own method, the cache's dtype), as the
        # latency bench reports them
        "resolved_quantization": getattr(worker, "quantization", None),
        "resolved_kv_cache_dtype": (str(worker.kv_cache_dtype).replace("torch.", "")
                                    if getattr(worker, "kv_cache_dtype", None) is not None
                                    else None),
    }
    # Release the engine (model weights, KV cache) before any peer runs.
    del outputs, llm, engine, executor, worker
    gc.collect()
    return result, info



def _roofline(info: dict, requests: list[SampleRequest], folio: EngineResult,
              early_bandwidth: float | None = None) -> dict | None:
    """The workload's floor (folio.bench.roofline.offline_floor) at the copy bandwidth and
    matmul peak measured now on folio's device, and folio's share of it."""
    from folio.bench import roofline
    if not info.get("device") or not folio.elapsed_s:
        return None
    from folio.bench import quant_bytes
    release_device_memory()  # the engine is gone; the probes need room on the device
    dtype_bytes = 4 if info.get("dtype") == "float32" else 2
    bits = quant_bytes.projection_bits(info["model_source"]["path"], info.get("quantization"))
    # the cache's own dtype where the engine chose it (float16 for a GGUF model on the CPU)
    kv_bytes = info.get("cache_dtype_bytes") or quant_bytes.kv_dtype_bytes(
        info.get("kv_cache_dtype"), dtype_bytes)
    bandwidth = roofline.best_copy_bandwidth(info["device"], early_bandwidth)
    flops = roofline.matmul_peak_flops(info["device"])
    floor = roofline.offline_floor(info["model_source"]["path"],
                                   [r.prompt_len for r in requests],
                                   [r.expected_output_len for r in requests],
                                   bandwidth, flops, dtype_bytes, projection_bits=bits,
                                   kv_dtype_bytes=kv_bytes,
                                   stored_weight_bytes=info.get("stored_weight_bytes"))
    fraction = floor["floor_s"] / folio.elapsed_s
    line = (f"roofline: floor {floor['floor_s']:.2f} s for this workload at "
            f"{bandwidth / 1e9:.1f} GB/s and {flops / 1e12:.1f} TFLOP/s measured "
            f"(ceiling {floor['output_tokens'] / floor['floor_s']:,.0f} out tok/s) → folio "
            f"achieved {100 * fraction:.1f}% of roofline")
    return {**floor, "bandwidth_bytes_per_s": bandwidth, "matmul_peak_flops_per_s": flops,
            "projection_bits": bits, "kv_dtype_bytes": kv_bytes,
            "fraction_of_roofline": fraction, "line": line}


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------

def _report(args: argparse.Namespace, results: list[EngineResult], info: dict) -> dict[str, Any]:
    folio = results[0]
    report: dict[str, Any] = {
        # vLLM's bench throughput keys, for folio.
        "elapsed_time": folio.elapsed_s,
        "num_requests": folio.num_requests,
        "total_num_tokens": folio.prompt_tokens + folio.output_tokens,
        "requests_per_second": folio.rates().get("requests_per_s"),
        "tokens_per_second": folio.rates().get("total_tokens_per_s"),
        "output_tokens_per_second": folio.rates().get("output_tokens_per_s"),
        "settings": {
            "num_prompts": args.num_prompts, "input_len_range": list(args.input_len_range),
            "output_len_range": list(args.output_len_range), "seed": args.seed,
            "temperature": args.temperature, "peer": list(args.peer),
            "peer_batch_size": args.peer_batch_size,
            "peer_cb_max_batch_tokens": args.peer_cb_max_batch_tokens,
            "peer_timeout": peer_timeout(args), "random_weights": args.random_weights,
            "config": args.config, "engine": _engine_kwargs(args),
        },
        "model": info["model_source"], "dtype": info["dtype"], "device": info["device"],
        "max_model_len": info["max_model_len"],
        # as the engine resolved them (a checkpoint's own method, the cache's dtype)
        "quantization": info.get("resolved_quantization"),
        "kv_cache_dtype": info.get("resolved_kv_cache_dtype"),
        # folio's start-to-ready (= engines[0].load_s), split; the random-weights build apart.
        "startup": folio.extra.get("startup"),
        "roofline": info.get("roofline"),
        "random_model": info.get("random_model"),
        "engines": [r.to_dict() for r in results],
    }
    folio_rate = folio.rates().get("output_tokens_per_s")
    for entry, result in zip(report["engines"], results):
        peer_rate = result.rates().get("output_tokens_per_s")
        entry["folio_over_this"] = (folio_rate / peer_rate) if folio_rate and peer_rate else None
    return report


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "-"


def _print_table(results: list[EngineResult], info: dict) -> None:
    folio = results[0]
    print()
    random_model = info.get("random_model")
    if random_model:
        how = (f"built in {random_model['build_s']:.1f} s on {random_model['generator']}"
               if random_model["built"] else "cached")
        print(f"random-weights model: {how} (not part of start-to-ready)")
    if folio.extra.get("startup"):
        print("folio " + format_startup(folio.extra["startup"]))
    print(f"model: {info['model_source']['path']} ({info['dtype']}, {info.get('device')}); "
          f"{folio.num_requests} "
          f"requests, {folio.prompt_tokens} prompt + {folio.output_tokens} output tokens")
    header = ["engine", "elapsed s", "req/s", "out tok/s", "total tok/s", "folio/peer",
              "peak RSS", "load s"]
    rows = [header]
    folio_rate = folio.rates().get("output_tokens_per_s")
    for r in results:
        if not r.ok:
            rows.append([r.engine, "-", "-", "-", "-", "-", _gib(r.peak_rss_bytes), "-"])
            continue
        rate = r.rates()
        ratio = "-" if r is folio or not folio_rate else f"{folio_rate / rate['output_tokens_per_s']:.2f}x"
        rows.append([r.engine, f"{r.elapsed_s:.2f}", f"{rate['requests_per_s']:.2f}",
                     f"{rate['output_tokens_per_s']:.1f}", f"{rate['total_tokens_per_s']:.1f}",
                     ratio, _gib(r.peak_rss_bytes), f"{r.load_s:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if r.error:
            print(f"{r.engine}: {r.error}")
            partial = r.extra.get("partial")
            if partial:
                print(f"{r.engine}: by then {partial['finished_requests']}/"
                      f"{partial['total_requests']} requests had finished, "
                      f"{partial['output_tokens']} output tokens in {partial['elapsed_s']:.1f} s of "
                      f"generation: >= {partial['output_tokens_per_s_lower_bound']:.1f} out tok/s")
            elif r.extra.get("timed_out"):
                print(f"{r.engine}: killed while {r.extra.get('phase')}")
        elif r.generated_tokens != r.output_tokens:
            print(f"{r.engine}: computed {r.generated_tokens} tokens for {r.output_tokens} "
                  f"useful ({r.generated_tokens - r.output_tokens} padding waste)")
        if r is not folio and r.extra.get("attn_implementation"):
            settings = r.extra.get("resolved") or {}
            print(f"{r.engine}: attn_implementation={r.extra['attn_implementation']}, "
                  f"device={r.extra.get('device')}"
                  + "".join(f", {k}={v}" for k, v in settings.items() if v is not None))
        for note in r.extra.get("notes", []):
            print(f"{r.engine}: {note}")
    if results and results[0].extra.get("spec_decode"):
        print("folio " + format_spec_report(results[0].extra["spec_decode"]))
    if info.get("roofline"):
        print(info["roofline"]["line"])
    print("peak RSS: each engine's own process (folio: this process; peers: a spawned child); "
          "baseline RSS before load: " + ", ".join(
              f"{r.engine} {_gib(r.baseline_rss_bytes)}" for r in results if r.baseline_rss_bytes))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, 'folio bench throughput',
                      'Offline throughput on random-token requests, optionally against a peer.',
                      add_cli_args, run)


if __name__ == "__main__":
    sys.exit(main())
