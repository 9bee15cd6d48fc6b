"""GPU profiling helper: where does a throughput step's time go? Warms up (Triton autotune),
then times the nano-vllm workload and prints the host-side profile. For the device tool."""
from __future__ import annotations

import cProfile
import os
import pstats
import random
import sys
import time

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model

num = int(sys.argv[1]) if len(sys.argv) > 1 else 256
model = build_random_model("qwen3-0.6b")
t0 = time.perf_counter()
llm = LLM(model, dtype="bfloat16", max_model_len=2048, max_num_seqs=256)
print(f"start-up {time.perf_counter() - t0:.1f} s", flush=True)
rng = random.Random(0)


def workload(n, lo, hi):
    reqs = [[rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(lo, hi), ignore_eos=True,
                             detokenize=False) for _ in range(n)]
    return [{"prompt_token_ids": r} for r in reqs], params


t0 = time.perf_counter()
llm.generate(*workload(64, 16, 300), use_tqdm=False)
print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
prompts, params = workload(num, 100, 1024)
out_tokens = sum(p.max_tokens for p in params)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
llm.generate(prompts, params, use_tqdm=False)
prof.disable()
elapsed = time.perf_counter() - t0
print(f"{num} requests, {out_tokens} output tokens in {elapsed:.1f} s: {out_tokens / elapsed:.0f} tok/s",
      flush=True)
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(25)
if os.environ.get("OUT"):
    stats.dump_stats(os.path.join(os.environ["OUT"], "throughput.prof"))
