"""GPU profiling helper: the host-side profile of batch-1 decode with and without a JSON-schema
constraint (same prompt, same length), to find what a constrained step adds. For the device
tool: python tools/gpu_profile_structured.py MODEL_DIR"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

from folio import LLM, SamplingParams
from folio.bench.structured_bench import LONG_SCHEMA
from folio.structured_output.params import StructuredOutputsParams as SO

llm = LLM(sys.argv[1], max_model_len=2048, max_num_seqs=16)
prompt = {"prompt_token_ids": list(range(1000, 1032))}
runs = {"free": SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
        "constrained": SamplingParams(temperature=0, max_tokens=128,
                                      structured_outputs=SO(json=LONG_SCHEMA))}
for params in runs.values():
    llm.generate([prompt], params, use_tqdm=False)  # warm-up, grammar compiled
for name, params in runs.items():
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    print(f"{name}: {1e3 * (time.perf_counter() - start) / 128:.3f} ms/token", flush=True)
for name, params in runs.items():
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    prof.disable()
    print(f"==== {name}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
