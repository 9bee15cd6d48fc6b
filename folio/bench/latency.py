"""`folio bench latency`: end-to-end latency of one batch, and decode time per token.

vLLM's `bench latency` semantics: every iteration is one `LLM.generate` of `--batch-size`
requests of `--input-len` random prompt tokens, each generating exactly `--output-len` tokens
(greedy, ignore_eos); after `--num-iters-warmup` untimed iterations, `--num-iters` are timed
and the median / p90 latency reported. On top of vLLM, the same batch is also run with
max_tokens=1 (prefill plus the first token), so the decode time per output token is
(latency − prefill latency) / (output_len − 1), free of TTFT; it is compared with the
memory-bandwidth floor of `folio.bench.roofline`. Unlike vLLM, each iteration draws fresh
prompts (same lengths), so default-on prefix caching cannot turn prefills into cache hits.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import numpy as np

from folio.bench import roofline
from folio.bench.datasets import special_token_ids
from folio.bench.peers import in_child
from folio.bench.random_model import RANDOM_CONFIGS, build_random_model

__all__ = ["add_cli_args", "main", "run"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (shared with `folio chat` / `bench throughput`) plus vLLM's latency flags."""
    from folio.engine.arg_utils import add_engine_args
    add_engine_args(parser, model_positional=False)
    group = parser.add_argument_group("workload")
    group.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    group.add_argument("--batch-size", type=int, default=1, help="requests per iteration")
    group.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    group.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    group.add_argument("--no-roofline", action="store_true",
                       help="skip measuring copy bandwidth and the roofline comparison")
    random_group = parser.add_argument_group("random weights")
    random_group.add_argument("--random-weights", action="store_true",
                              help="benchmark a model with random weights and the shapes of --config")
    random_group.add_argument("--config", choices=sorted(RANDOM_CONFIGS), default=None,
                              help="the shapes for --random-weights")
    random_group.add_argument("--random-num-layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output-json", default=None, help="write the results to this file")


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


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`, print a summary and return the results."""
    from folio import LLM, SamplingParams
    from folio.engine.arg_utils import engine_kwargs_from_args

    _validate(args)
    kwargs = engine_kwargs_from_args(args)
    if args.random_weights:
        # In a child process, as throughput does: the builder's peak memory stays out of ours.
        kwargs["model"] = in_child(build_random_model, args.config, None, args.random_num_layers)
        print(f"random-weights model ({args.config}): {kwargs['model']}", flush=True)

    llm = LLM(**kwargs)
    engine = llm.llm_engine
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"input-len + output-len = {args.input_len + args.output_len} exceeds "
                         f"max_model_len {engine.max_model_len}")
    vocab_size = engine.model_info.vocab_size
    excluded = np.fromiter(special_token_ids(llm.get_tokenizer()), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
    rng = np.random.default_rng(args.seed)

    def fresh_batch() -> list[dict[str, list[int]]]:
        # New random prompts for every call: prefix caching is on by default, and re-sending
        # one fixed batch (as vLLM does) would turn every prefill after the first into a cache
        # hit, understating latency and the prefill time subtracted below.
        return [{"prompt_token_ids": rng.choice(allowed, size=args.input_len).tolist()}
                for _ in range(args.batch_size)]

    def timed(max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        prompts = fresh_batch()  # drawn before the timer starts
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    for _ in range(args.num_iters_warmup):
        timed(args.output_len)
    latencies, output_tokens = [], []
    for _ in range(args.num_iters):
        elapsed, n = timed(args.output_len)
        latencies.append(elapsed)
        output_tokens.append(n)
    # Prefill-only runs (max_tokens=1): same count, so the medians are comparable. One warm-up
    # because a 1-token request can hit shapes (no decode) the full runs did not compile.
    timed(1)
    prefill = [timed(1)[0] for _ in range(args.num_iters)]

    median_latency = _median(latencies)
    median_prefill = _median(prefill)
    per_token_s = ((median_latency - median_prefill) / (args.output_len - 1)
                   if args.output_len > 1 else None)
    worker = getattr(getattr(engine.engine_core, "executor", None), "worker", None)
    device = getattr(worker, "device", None)
    dtype = getattr(worker, "dtype", None)
    model_path = engine.model_source.path

    report: dict[str, Any] = {
        # vLLM's bench latency keys.
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): _percentile(latencies, p) for p in (10, 25, 50, 75, 90, 99)},
        # folio's additions.
        "median_latency_s": median_latency,
        "p90_latency_s": _percentile(latencies, 90),
        "prefill_latencies": prefill,
        "median_prefill_latency_s": median_prefill,
        "median_decode_ms_per_token": per_token_s * 1e3 if per_token_s is not None else None,
        "decode_tokens_per_s_per_seq": (1.0 / per_token_s) if per_token_s and per_token_s > 0 else None,
        "output_tokens_per_iter": output_tokens,
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
        "model": {"kind": engine.model_source.kind, "path": model_path},
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "device": str(device) if device is not None else None,
        "roofline": None,
    }
    if per_token_s is not None and per_token_s <= 0:
        print("warning: decode time per token came out <= 0 (prefill noise dominates); "
              "raise --output-len or --num-iters", file=sys.stderr)
    del llm, engine, worker
    gc.collect()  # free the engine's memory before the bandwidth probe allocates its buffers

    if not args.no_roofline and per_token_s and per_token_s > 0 and device is not None:
        report["roofline"] = _roofline(args, model_path, device, dtype, per_token_s)

    _print_summary(report)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


def _median(values: list[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _roofline(args: argparse.Namespace, model_path: str, device: Any, dtype: Any,
              per_token_s: float) -> dict[str, Any]:
    dtype_bytes = int(getattr(dtype, "itemsize", 2))
    # Decode steps see contexts from input_len + 1 to input_len + output_len - 1; bytes are
    # linear in the context, so the mean step reads the KV of the midpoint context.
    context = args.input_len + args.output_len // 2
    step_bytes = roofline.decode_bytes_per_step(model_path, args.batch_size, context, dtype_bytes)
    bandwidth = roofline.measure_copy_bandwidth(device)
    floor_s = step_bytes / bandwidth  # one step yields one token for every sequence
    return {"bytes_per_step": step_bytes, "context_len": context, "dtype_bytes": dtype_bytes,
            "bandwidth_bytes_per_s": bandwidth, "floor_ms_per_token": floor_s * 1e3,
            "fraction_of_roofline": floor_s / per_token_s,
            "line": roofline.roofline_line(floor_s, bandwidth, per_token_s)}


def _print_summary(report: dict[str, Any]) -> None:
    print()
    print(f"model: {report['model']['path']} ({report['dtype']}, {report['device']}); "
          f"batch {report['batch_size']}, input {report['input_len']}, "
          f"output {report['output_len']}, {report['num_iters']} iterations")
    print(f"latency: median {report['median_latency_s'] * 1e3:.2f} ms, "
          f"p90 {report['p90_latency_s'] * 1e3:.2f} ms, avg {report['avg_latency'] * 1e3:.2f} ms")
    print(f"prefill (max_tokens=1): median {report['median_prefill_latency_s'] * 1e3:.2f} ms")
    if report["median_decode_ms_per_token"] is not None:
        rate = report["decode_tokens_per_s_per_seq"]
        print(f"decode: median {report['median_decode_ms_per_token']:.3f} ms/token, "
              f"{rate:.1f} tokens/s per sequence" if rate else
              f"decode: median {report['median_decode_ms_per_token']:.3f} ms/token")
    if report["roofline"]:
        print(report["roofline"]["line"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="folio bench latency",
                                     description="Latency of one batch; decode time per token.")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"folio bench latency: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
