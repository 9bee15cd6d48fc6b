"""Where an embeddings run's time goes on the GPU (issue 19): LLM.embed over the benchmark's
texts at several token budgets, each under cProfile (top functions by own time), with the
engine's step count. Usage: python3 tools/gpu_profile_embed.py MODEL_DIR [BUDGET ...]"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

from folio import LLM
from folio.bench.texts import stdlib_texts


def main() -> None:
    model = sys.argv[1]
    budgets = [int(b) for b in sys.argv[2:]] or [2048, 16384]
    texts = stdlib_texts(1000)
    for budget in budgets:
        llm = LLM(model, max_num_batched_tokens=budget, max_num_seqs=1024)
        llm.embed(texts[:64], truncate_prompt_tokens=-1, use_tqdm=False)
        core = llm.llm_engine.engine_core
        steps_before = core.scheduler._step_id
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        profile.disable()
        elapsed = time.perf_counter() - start
        print(f"budget {budget}: {len(texts) / elapsed:.1f} sentences/s, "
              f"{core.scheduler._step_id - steps_before} steps, {elapsed:.3f} s", flush=True)
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
