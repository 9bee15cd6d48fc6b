"""GPU profiling helper: which kernels take a large batch's GPU time? Runs 256 requests of a
600-token prompt and 48 output tokens on the Qwen3-0.6B shape (after a warm-up) under
torch.profiler and prints the kernels by total GPU time, the GPU-busy total and the wall time.
For the device tool."""
from __future__ import annotations

import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model

num = int(sys.argv[1]) if len(sys.argv) > 1 else 256
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 600
output_len = int(sys.argv[3]) if len(sys.argv) > 3 else 48
llm = LLM(build_random_model("qwen3-0.6b"), dtype="bfloat16", max_model_len=2048,
          max_num_seqs=256)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(prompt_len)]}
           for _ in range(num)]
params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
llm.generate(prompts[:32], params, use_tqdm=False)
llm.reset_prefix_cache()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
events = prof.key_averages()
busy_us = sum(e.self_device_time_total for e in events)
print(f"{num} x ({prompt_len} in, {output_len} out): wall {wall * 1e3:.0f} ms, GPU busy "
      f"{busy_us / 1e3:.0f} ms ({100 * busy_us / 1e3 / (wall * 1e3):.0f}% of wall)")
print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
