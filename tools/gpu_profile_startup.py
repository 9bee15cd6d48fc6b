"""Where a start goes (issue 21, item 7): cProfile around `LLM(...)` on a random-weight model
(built first, outside the profile), the functions with the most cumulative time, and the
worker's stage timings. Run it twice on a machine: the first start fills the Triton cache,
the second is the warm restart the target is about.

python3 tools/gpu_profile_startup.py [--config qwen3-0.6b] [--top 45]"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    start = time.perf_counter()
    from folio import LLM
    from folio.bench.random_model import build_random_model
    imported = time.perf_counter() - start
    path = build_random_model(args.config)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=args.max_model_len)
    profile.disable()
    total = time.perf_counter() - start
    timings = llm.llm_engine.engine_core.executor.timings
    print(f"import folio: {imported:.2f} s; LLM(): {total:.2f} s; worker stages: "
          + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
