"""GPU helper (issue 17's target "a verify step of k=4 costs <= 1.15x a plain decode step",
Llama-3-8B shape, batch 1): engine steps timed by hand (EngineCore.step_times), once without
speculation and once with n-gram speculation whose proposer is replaced here by one that
always drafts k tokens (the last token repeated), so every decode step is a verify step of
k + 1 tokens whatever the random weights say. Steps of the prefill are left out of both
medians by timing only after the first token.

python tools/gpu_verify_cost.py [--config llama3-8b] [--k 4] [--output-len 256]

Each run also prints the host's time per step in each part of EngineCore.step (schedule,
launch, wait, update) over 64 more steps; --gaps, the device's idle time between kernels.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model


def _always_draft(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
    return [token_ids[-1]] * k if k > 0 else []


def _step_times(llm: LLM, prompt: list[int], output_len: int) -> tuple[list[float], int]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    engine.add_request("verify-cost", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill
    times = []
    steps = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        steps += 1
    return times, steps


def _profile(llm: LLM, prompt: list[int], label: str) -> None:
    """GPU time per decode step against its wall time (host-bound or kernel-bound?), and
    the kernels taking most of it."""
    from torch.profiler import ProfilerActivity, profile
    steps = 16
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        times, _ = _step_times(llm, prompt, steps + 1)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"{label} profile: wall {statistics.fmean(times) * 1e3:.3f} ms/step (profiled), "
          f"GPU busy {gpu_us / 1e3 / (steps + 1):.3f} ms/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {label} {e.self_device_time_total / 1e3 / (steps + 1):8.3f} ms/step "
              f"{e.count:6d}x {e.key[:90]}")


def _gaps(llm: LLM, prompt: list[int], label: str, steps: int = 16) -> None:
    """The device's idle time per step: the gaps between consecutive kernels in a profile of
    `steps` decode steps (a verify step's exposed host work shows as a gap before it), the
    sum per step and the largest, with the kernels on either side."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step_times(llm, prompt, steps + 1)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type.name == "CUDA")
    gaps = []
    busy_end = kernels[0][1] if kernels else 0.0
    for (_, _, before), (start, end, after) in zip(kernels, kernels[1:]):
        if start > busy_end:
            gaps.append((start - busy_end, before, after))
        busy_end = max(busy_end, end)
    span = (busy_end - kernels[0][0]) / 1e3 if kernels else 0.0
    idle = sum(g for g, _, _ in gaps) / 1e3
    big = sorted(gaps, reverse=True)
    print(f"{label} gaps: {len(kernels)} kernels over {span:.3f} ms ({steps + 1} steps), idle "
          f"{idle:.3f} ms = {idle / (steps + 1):.3f} ms/step; gaps > 50 us: "
          f"{sum(1 for g, _, _ in gaps if g > 50)}")
    for g, before, after in big[:6]:
        print(f"  {label} gap {g:8.1f} us after {before[:50]} before {after[:50]}")


def _breakdown(llm: LLM, prompt: list[int], label: str, steps: int = 64) -> None:
    """Host milliseconds per step in each part of EngineCore.step (schedule, launch, wait
    for the device, update): where a verify step's exposed host work goes."""
    from folio.engine.engine_core import StepTimes
    core = llm.llm_engine.engine_core
    times = core.step_times = StepTimes()
    try:
        _step_times(llm, prompt, steps + 1)
    finally:
        core.step_times = None
    n = max(1, times.steps)
    print(f"{label} breakdown ({times.steps} steps): schedule "
          f"{times.schedule_s / n * 1e3:.3f}, launch {times.launch_s / n * 1e3:.3f}, wait "
          f"{times.wait_s / n * 1e3:.3f}, update {times.update_s / n * 1e3:.3f} ms/step")


def _host_profile(llm: LLM, prompt: list[int], label: str, steps: int = 64) -> None:
    """cProfile over `steps` engine steps: which host functions the step's exposed time goes
    to (a verify step's scheduling and launch are not hidden behind the device)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    _step_times(llm, prompt, steps + 1)
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(28)
        body = text.getvalue().split("filename:lineno(function)", 1)[-1]
        print(f"{label} host profile by {key} ({steps + 1} steps):")
        for line in body.strip().splitlines():
            print(f"  {label} {line[:150]}")


# The host's path through a step, in order: (owner module, class, method, label). Each is
# wrapped to stamp its start and end, so a verify step's exposed turn-around (from the kept
# tokens' arrival to the next step's first replay) splits into its parts.
_TIMELINE_POINTS = (
    ("folio.worker.model_runner", "PendingRunnerOutput", "get", "get"),
    ("folio.core.scheduler", "Scheduler", "update_from_output", "update"),
    ("folio.core.scheduler", "Scheduler", "schedule", "schedule"),
    ("folio.worker.model_runner", "ModelRunner", "execute_model_async", "launch"),
    ("folio.worker.input_batch", "InputBatch", "update", "batch_update"),
    ("folio.worker.flat_batch", None, "build_flat_batch", "build"),
    ("folio.worker.flat_batch", "StepBuffers", "copy_to", "copy"),
    ("torch.cuda", "CUDAGraph", "replay", "replay"),
)


def _host_timeline(llm: LLM, prompt: list[int], label: str, steps: int = 64) -> None:
    """Median host microseconds of each stretch between the stamped points of a step (the
    wrappers cost ~1 us each): what a verify step's exposed turn-around is made of."""
    import importlib
    stamps: list[tuple[str, float]] = []
    restore = []
    for module_name, cls_name, attr, name in _TIMELINE_POINTS:
        module = importlib.import_module(module_name)
        owner = getattr(module, cls_name) if cls_name else module
        original = getattr(owner, attr)

        def wrapped(*a, _f=original, _n=name, **kw):
            stamps.append((_n + "<", time.perf_counter()))
            try:
                return _f(*a, **kw)
            finally:
                stamps.append((_n + ">", time.perf_counter()))
        setattr(owner, attr, wrapped)
        restore.append((owner, attr, original))
        if module_name == "folio.worker.flat_batch" and cls_name is None:
            # the graph runners imported the function by name
            for user in ("folio.worker.mixed_graphs", "folio.worker.cuda_graphs",
                         "folio.worker.model_runner"):
                mod = importlib.import_module(user)
                if getattr(mod, attr, None) is original:
                    setattr(mod, attr, wrapped)
                    restore.append((mod, attr, original))
    per_step: list[list[tuple[str, float]]] = []
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True,
                            detokenize=False)
    try:
        engine.add_request("timeline", {"prompt_token_ids": prompt}, params)
        engine.step()
        while engine.has_unfinished_requests():
            stamps.clear()
            stamps.append(("step<", time.perf_counter()))
            engine.step()
            stamps.append(("step>", time.perf_counter()))
            per_step.append(list(stamps))
    finally:
        for owner, attr, original in reversed(restore):
            setattr(owner, attr, original)
    stretches: dict[str, list[float]] = {}
    for trace in per_step[2:]:
        seen: dict[str, int] = {}
        for (a, ta), (b, tb) in zip(trace, trace[1:]):
            key = f"{a} -> {b}"
            n = seen[key] = seen.get(key, 0) + 1
            stretches.setdefault(key if n == 1 else f"{key} #{n}", []).append((tb - ta) * 1e6)
    print(f"{label} host timeline ({len(per_step) - 2} steps, median us per stretch, in order):")
    for key, values in stretches.items():
        print(f"  {label} {statistics.median(values):9.1f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="llama3-8b")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 16 steps of each (GPU time per step, top kernels)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also cProfile 65 steps of each (host functions)")
    parser.add_argument("--gaps", action="store_true",
                        help="also the device's idle gaps between kernels over 17 steps of each")
    parser.add_argument("--host-timeline", action="store_true",
                        help="also the host's microseconds between the step's stamped points")
    parser.add_argument("--whole-graphs", action="store_true",
                        help="capture small mixed steps as one graph, not in pieces (the A/B "
                             "of worker/mixed_graphs.PIECEWISE_MAX_TOKENS)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers (a CPU check)")
    args = parser.parse_args()
    from folio.core.spec.ngram import NgramProposer
    if args.whole_graphs:
        from folio.worker import mixed_graphs
        mixed_graphs.PIECEWISE_MAX_TOKENS = 0
    model = build_random_model(args.config, num_layers=args.num_layers)
    prompt = list(range(1000, 1128))
    results = {}
    for label, spec in (("plain", None),
                        ("verify", {"method": "ngram", "num_speculative_tokens": args.k,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                    "adaptive_draft_length": False})):
        original = NgramProposer.propose
        if spec is not None:
            NgramProposer.propose = _always_draft
        try:
            llm = LLM(model, dtype="bfloat16", max_model_len=2048, max_num_seqs=4,
                      speculative_config=spec, enforce_eager=args.enforce_eager)
            _step_times(llm, prompt, 32)  # warm-up: autotune, graphs
            times, steps = _step_times(llm, prompt, args.output_len)
            stats = llm.llm_engine.engine_core.scheduler.stats()
            _breakdown(llm, prompt, label)
            if args.profile:
                _profile(llm, prompt, label)
            if args.gaps:
                _gaps(llm, prompt, label)
            if args.host_profile:
                _host_profile(llm, prompt, label)
            if args.host_timeline:
                _host_timeline(llm, prompt, label)
        finally:
            NgramProposer.propose = original
        median = statistics.median(times) * 1e3
        results[label] = median
        print(f"{label}: {steps} steps, median {median:.3f} ms/step, mean "
              f"{statistics.fmean(times) * 1e3:.3f}; drafts {stats.spec_num_drafts}, "
              f"draft tokens {stats.spec_num_draft_tokens}, accepted "
              f"{stats.spec_num_accepted_tokens}")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"verify step (k={args.k}) / plain decode step: "
          f"{results['verify'] / results['plain']:.3f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
