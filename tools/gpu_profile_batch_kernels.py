"""GPU profiling helper: which kernels take a large batch's GPU time? Runs NUM requests of a
PROMPT_LEN-token prompt and OUTPUT_LEN output tokens on a random-weight model shape (after a
warm-up) under torch.profiler and prints the kernels by total GPU time, the GPU-busy total and
the wall time. For the device tool:

    python tools/gpu_profile_batch_kernels.py [NUM PROMPT_LEN OUTPUT_LEN] [--config qwen3-0.6b]
        [--quantization fp8] [--kv-cache-dtype fp8] [--random-quantization w4a16]
        [--num-layers N] [--max-model-len 2048] [--max-num-batched-tokens N]

On Hopper the decode kernels launch with programmatic dependent launch, and then each
kernel's time includes its wait for the one before it (batch-1 FP8 decode showed
_rmsnorm_kernel at 23 % of the GPU time): run with FOLIO_PDL=0 for per-kernel times.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model_info

parser = argparse.ArgumentParser()
parser.add_argument("num", type=int, nargs="?", default=256)
parser.add_argument("prompt_len", type=int, nargs="?", default=600)
parser.add_argument("output_len", type=int, nargs="?", default=48)
parser.add_argument("--config", default="qwen3-0.6b")
parser.add_argument("--quantization", default=None)
parser.add_argument("--kv-cache-dtype", default="auto")
parser.add_argument("--random-quantization", default=None)
parser.add_argument("--num-layers", type=int, default=None)
parser.add_argument("--max-model-len", type=int, default=2048)
parser.add_argument("--max-num-batched-tokens", type=int, default=None)
args = parser.parse_args()
model = build_random_model_info(args.config, quantization=args.random_quantization,
                                num_layers=args.num_layers)["path"]
llm = LLM(model, dtype="bfloat16", max_model_len=args.max_model_len, max_num_seqs=256,
          max_num_batched_tokens=args.max_num_batched_tokens,
          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]}
           for _ in range(args.num)]
params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                        detokenize=False)
llm.generate(prompts[:32], params, use_tqdm=False)
llm.reset_prefix_cache()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
events = prof.key_averages()
busy_us = sum(e.self_device_time_total for e in events)
print(f"{args.config} {args.quantization or args.random_quantization or 'bf16'} kv "
      f"{args.kv_cache_dtype}: {args.num} x ({args.prompt_len} in, {args.output_len} out): "
      f"wall {wall * 1e3:.0f} ms, GPU busy {busy_us / 1e3:.0f} ms "
      f"({100 * busy_us / 1e3 / (wall * 1e3):.0f}% of wall)")
print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
