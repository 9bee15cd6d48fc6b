"""Where an embeddings run's time goes on the GPU (issue 19): LLM.embed over the benchmark's
texts at several token budgets, each under cProfile (top functions by own time), with the
engine's step count. Usage: python3 tools/gpu_profile_embed.py MODEL_DIR [BUDGET ...]
[--timeline]: instead, at each budget, one pass split into wall-clock parts (requests added,
engine steps, the engine core's own parts: scheduling, launch, waiting for the device,
taking outputs in) beside the device's kernel time (torch.profiler)."""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

from folio import LLM
from folio.bench.texts import stdlib_texts


def timed(owner, name: str, totals: dict) -> None:
    """Wrap owner.name so that its wall time adds up in totals[name]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)


def timeline(llm: LLM, texts: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from folio.engine.engine_core import StepTimes
    core = llm.llm_engine.engine_core
    totals: dict[str, float] = {}
    timed(llm.llm_engine, "add_pooling_request", totals)
    timed(llm, "_step", totals)
    core.step_times = times = StepTimes()
    start = time.perf_counter()
    llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    elapsed = time.perf_counter() - start
    core.step_times = None
    print(f"  pass {elapsed * 1e3:.1f} ms: requests added {totals['add_pooling_request'] * 1e3:.1f}"
          f" ms, engine steps {totals['_step'] * 1e3:.1f} ms in {times.steps} steps (schedule "
          f"{times.schedule_s * 1e3:.1f}, launch {times.launch_s * 1e3:.1f}, wait for the "
          f"device {times.wait_s * 1e3:.1f}, outputs in {times.update_s * 1e3:.1f})", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    print(f"  device kernel time of a pass: {kernels:.1f} ms", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)[:3000])


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = args[0]
    budgets = [int(b) for b in args[1:]] or [2048, 16384]
    texts = stdlib_texts(1000)
    for budget in budgets:
        llm = LLM(model, max_num_batched_tokens=budget, max_num_seqs=1024)
        llm.embed(texts[:64], truncate_prompt_tokens=-1, use_tqdm=False)
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)   # warm: every shape once
        core = llm.llm_engine.engine_core
        if "--timeline" in sys.argv:
            print(f"budget {budget}:", flush=True)
            timeline(llm, texts)
            llm.llm_engine.shutdown()
            continue
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
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
        llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
