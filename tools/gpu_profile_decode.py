"""GPU profiling helper: where does a batch-1 decode step's time go? Times one request of
OUTPUT_LEN greedy tokens with and without the Python profiler, and splits each step into
schedule / execute (forward + sample) / update / output processing. For the device tool."""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model

config = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
output_len = int(sys.argv[2]) if len(sys.argv) > 2 else 256
llm = LLM(build_random_model(config), dtype="bfloat16", max_model_len=2048, max_num_seqs=8)
engine = llm.llm_engine
core = engine.engine_core
params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
prompt = {"prompt_token_ids": list(range(1000, 1032))}
llm.generate([prompt], params, use_tqdm=False)  # warm-up (autotune, graphs)

parts = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "output": 0.0}
steps = 0
engine.add_request("timed", prompt, params)
t_all = time.perf_counter()
while engine.has_unfinished_requests():
    t0 = time.perf_counter()
    so = core.scheduler.schedule()
    t1 = time.perf_counter()
    ro = core.executor.execute_model(so)
    t2 = time.perf_counter()
    outs = core.scheduler.update_from_output(so, ro)
    t3 = time.perf_counter()
    engine.output_processor.process(outs)
    t4 = time.perf_counter()
    parts["schedule"] += t1 - t0
    parts["execute"] += t2 - t1
    parts["update"] += t3 - t2
    parts["output"] += t4 - t3
    steps += 1
total = time.perf_counter() - t_all
print(f"{config}: {steps} steps, {1e3 * total / steps:.3f} ms/step "
      + " ".join(f"{k} {1e3 * v / steps:.3f}" for k, v in parts.items()), flush=True)

prof = cProfile.Profile()
prof.enable()
llm.generate([prompt], params, use_tqdm=False)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)

# Kernel breakdown: the same decode steps under torch.profiler (graphs replay as one launch,
# so profile the eager model to see each kernel and its GPU time).
if "--kernels" in sys.argv:
    import torch
    from torch.profiler import ProfilerActivity, profile
    del llm, engine, core
    torch.cuda.empty_cache()
    eager = LLM(build_random_model(config), dtype="bfloat16", max_model_len=2048, max_num_seqs=8,
                enforce_eager=True, gpu_memory_utilization=0.5)
    short = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eager.generate([prompt], short, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as kprof:
        eager.generate([prompt], short, use_tqdm=False)
    events = [e for e in kprof.key_averages()]
    total_gpu_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"eager: {launches} kernel launches for 32 tokens ({launches / 32:.0f}/token), "
          f"GPU busy {total_gpu_us / 32 / 1e3:.3f} ms/token", flush=True)
    print(kprof.key_averages().table(sort_by="self_device_time_total", row_limit=20,
                                     max_name_column_width=60))
