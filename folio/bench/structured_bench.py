"""`python -m folio.bench.structured_bench`: what constrained decoding costs.

1. Compile time: every schema of a suite compiled cold (a fresh compiler per backend) and
   again (the cache), with the backend `auto` picked for each.
2. First-request latency: one request with a schema the engine has not seen, against the same
   request unconstrained (the compile happens off the busy loop, but this request waits).
3. Per-token cost: batch 1 and batch 16, a schema that keeps the model writing (a long array)
   against unconstrained generation of the same length; median decode time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams as SO

# Keeps the model writing: an array of at least 64 small objects, so max_tokens ends it.
LONG_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 64,
    "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tag": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"],
        "additionalProperties": False}}}, "required": ["rows"], "additionalProperties": False}


def _suite() -> list[dict]:
    root = Path(__file__).resolve().parents[2] / "tests" / "structured_output"
    sys.path.insert(0, str(root))
    try:
        from schema_suite import SCHEMAS  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("the structured-output bench reads its schemas from the source "
                         "checkout's tests/structured_output/schema_suite.py; run it from a "
                         "git clone of folio") from None
    return [schema for _, _, schema in SCHEMAS]


def compile_times(tokenizer: Any, vocab_size: int, eos: list[int]) -> dict[str, Any]:
    from folio.structured_output.compilers import StructuredOutputCompiler
    compiler = StructuredOutputCompiler(tokenizer, vocab_size, "auto", stop_token_ids=eos)
    compiler.compile(SO(json_object=True))  # backend start-up (tokenizer tables), not per schema
    first, cached, backends = [], [], []
    for schema in _suite():
        params = SO(json=schema, disable_any_whitespace=True)
        start = time.perf_counter()
        compiled = compiler.compile(params)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(params)
        cached.append(time.perf_counter() - start)
        backends.append(compiled.backend)
    ms = lambda xs: {"mean": 1e3 * statistics.mean(xs), "median": 1e3 * statistics.median(xs),  # noqa: E731
                     "max": 1e3 * max(xs)}
    return {"schemas": len(first), "first_ms": ms(first), "cached_ms": ms(cached),
            "backends": {b: backends.count(b) for b in sorted(set(backends))}}


def _decode_ms_per_step(llm: Any, prompts: list, params: list[SamplingParams]) -> float:
    """Median wall time of the decode steps (every request decoding) of one batch."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"t{time.monotonic_ns()}-{i}", prompt, p)
    times = []
    while engine.has_unfinished_requests():
        running = engine.engine_core.scheduler.running
        decoding = len(running) == len(prompts) and all(
            r.num_computed_tokens >= r.num_tokens - 1 for r in running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from folio import LLM
    kwargs: dict[str, Any] = {"max_model_len": 2048}
    if args.model:
        kwargs["model"] = args.model
    if args.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    report: dict[str, Any] = {"model": engine.model_source.path,
                              "device": engine.engine_core.executor.device_type}
    report["compile"] = compile_times(engine.tokenizer, engine.engine_core.executor.vocab_size,
                                      list(engine.eos_token_ids))

    prompt = {"prompt_token_ids": engine.tokenizer.encode("Write the table as JSON:")}
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([prompt], free, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], free, use_tqdm=False)
    unconstrained = time.perf_counter() - start
    fresh = dict(LONG_SCHEMA, title="first-request probe")  # a schema no cache has seen
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                          structured_outputs=SO(json=fresh)), use_tqdm=False)
    report["first_request"] = {"unconstrained_ms": 1e3 * unconstrained,
                               "new_schema_ms": 1e3 * (time.perf_counter() - start)}

    per_token = {}
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": engine.tokenizer.encode(f"Table {i} as JSON:")}
                   for i in range(batch)]
        free = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * batch
        constrained = [SamplingParams(temperature=0, max_tokens=args.output_len,
                                      structured_outputs=SO(json=LONG_SCHEMA))] * batch
        _decode_ms_per_step(llm, prompts, constrained)  # warm the grammar cache
        base = _decode_ms_per_step(llm, prompts, free)
        with_grammar = _decode_ms_per_step(llm, prompts, constrained)
        per_token[batch] = {"unconstrained_ms": base, "constrained_ms": with_grammar,
                            "overhead_pct": 100 * (with_grammar / base - 1)}
    report["per_step"] = per_token
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m folio.bench.structured_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded default)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    report = run(args)
    c = report["compile"]
    print(f"model {report['model']} on {report['device']}")
    print(f"compile, {c['schemas']} schemas (backends {c['backends']}): first "
          f"mean {c['first_ms']['mean']:.1f} / median {c['first_ms']['median']:.1f} / max "
          f"{c['first_ms']['max']:.1f} ms; cached mean {c['cached_ms']['mean']:.3f} ms")
    f = report["first_request"]
    print(f"first request with a new schema: {f['new_schema_ms']:.1f} ms vs "
          f"{f['unconstrained_ms']:.1f} ms unconstrained (8 tokens)")
    for batch, row in report["per_step"].items():
        print(f"batch {batch}: decode step {row['constrained_ms']:.2f} ms constrained vs "
              f"{row['unconstrained_ms']:.2f} ms free ({row['overhead_pct']:+.1f}%)")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
