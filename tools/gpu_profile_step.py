"""GPU helper: the host-side profile (cProfile, by own time) of batch-1 decode on the
Qwen3-0.6B shape, after a warm-up, with each engine step's parts timed
(EngineCore.step_times). For the device tool: python tools/gpu_profile_step.py [OUTPUT_LEN]"""
from __future__ import annotations

import cProfile
import pstats
import sys

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model

output_len = int(sys.argv[1]) if len(sys.argv) > 1 else 256
llm = LLM(build_random_model("qwen3-0.6b"), dtype="bfloat16", max_model_len=2048, max_num_seqs=8)
params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
prompt = {"prompt_token_ids": list(range(1000, 1032))}
llm.generate([prompt], params, use_tqdm=False)  # warm-up (autotune, graphs)
prof = cProfile.Profile()
prof.enable()
llm.generate([prompt], params, use_tqdm=False)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
