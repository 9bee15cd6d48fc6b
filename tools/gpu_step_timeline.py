"""GPU helper: where does the offline throughput workload's wall time go, step by step, without
a profiler's overhead? Runs the benchmark's workload (256 requests, prompt and output lengths
uniform in [100, 1024], Qwen3-0.6B shape, random weights) twice, timed, and
records per engine step:
  * host time in the engine step (schedule + launch + waiting for and applying the previous
    step's output), the launch alone, and the blocking wait for sampled ids;
  * CUDA events at the start and end of each step's launch: the GPU span of a step and the
    GPU idle gap between one step's end and the next one's start.
Prints totals for pure-decode steps and mixed steps (those with a prefill chunk), for a cold
run (the first of the process, as `folio bench throughput` measures) and a warm one, and the
slowest steps of each.

    python tools/gpu_step_timeline.py [NUM_PROMPTS] [extra LLM kwargs as key=value ...]
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from folio import LLM, SamplingParams
from folio.bench.datasets import sample_random_requests
from folio.bench.random_model import build_random_model
from folio.engine.engine_core import EngineCore
from folio.worker import model_runner as mr


def _parse(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


class _HostEvent:
    """Stand-in for torch.cuda.Event off the GPU (a smoke run of this script on the CPU)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


num = int(sys.argv[1]) if len(sys.argv) > 1 else 256
extra = dict(kv.split("=", 1) for kv in sys.argv[2:])
model = extra.pop("model", None)
max_len = int(extra.pop("max_len", 1024))
kwargs = dict(dtype="bfloat16", max_model_len=2048, max_num_seqs=256)
kwargs.update({k: _parse(v) for k, v in extra.items()})
llm = LLM(model or build_random_model("qwen3-0.6b"), **kwargs)
vocab = llm.llm_engine.model_info.vocab_size
requests = sample_random_requests(num, (min(100, max_len), max_len), (min(100, max_len), max_len),
                                  vocab, seed=0)
Event = (lambda: torch.cuda.Event(enable_timing=True)) if torch.cuda.is_available() else _HostEvent
prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, detokenize=False,
                         max_tokens=r.expected_output_len) for r in requests]

records: list[dict] = []
current: dict = {}
orig_step = EngineCore.step
orig_launch = mr.ModelRunner.execute_model_async
orig_get = mr.PendingRunnerOutput.get


def step(self):
    t0 = time.perf_counter()
    current.clear()
    out = orig_step(self)
    if "start" in current:  # a step that launched work (not one that only drained)
        current["host"] = time.perf_counter() - t0
        records.append(dict(current))
    return out


def launch(self, scheduler_output, grammar_bitmask=None):
    sched = scheduler_output.scheduled
    start, end = Event(), Event()
    t0 = time.perf_counter()
    start.record()
    pending = orig_launch(self, scheduler_output, grammar_bitmask)
    end.record()
    if sched:
        current.update(
            kind="decode" if all(s.num_new_tokens == 1 for s in sched) else "mixed",
            reqs=len(sched), tokens=sum(s.num_new_tokens for s in sched),
            launch=time.perf_counter() - t0, start=start, end=end, wait=current.get("wait", 0.0))
    return pending


def get(self):
    t0 = time.perf_counter()
    out = orig_get(self)
    current["wait"] = current.get("wait", 0.0) + time.perf_counter() - t0
    return out


EngineCore.step = step
mr.ModelRunner.execute_model_async = launch
mr.PendingRunnerOutput.get = get


def timed_run(label: str) -> None:
    records.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    llm.reset_prefix_cache()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, r in enumerate(records):
        r["span"] = r["start"].elapsed_time(r["end"])
        r["idle"] = (r["end"].elapsed_time(records[i + 1]["start"])
                     if i + 1 < len(records) else 0.0)
        s = sums[r["kind"]]
        s["steps"] += 1
        s["tokens"] += r["tokens"]
        s["reqs"] += r["reqs"]
        s["host_ms"] += r["host"] * 1e3
        s["launch_ms"] += r["launch"] * 1e3
        s["wait_ms"] += r["wait"] * 1e3
        s["gpu_span_ms"] += r["span"]
        s["idle_after_ms"] += r["idle"]
    print(f"== {label}: {num} requests, {tokens} output tokens in {wall:.2f} s = "
          f"{tokens / wall:,.0f} tok/s; kwargs {kwargs}")
    print(f"host in engine steps {sum(r['host'] for r in records):.2f} s of {wall:.2f} s wall")
    cols = ["steps", "reqs", "tokens", "host_ms", "launch_ms", "wait_ms", "gpu_span_ms",
            "idle_after_ms"]
    print(f"{'kind':8s} " + " ".join(f"{c:>13s}" for c in cols) + "   (reqs/tokens: per step; "
          "ms: total/per step)")
    for kind, s in sums.items():
        n = s["steps"]
        vals = [f"{n:13.0f}", f"{s['reqs'] / n:13.1f}", f"{s['tokens'] / n:13.1f}"]
        vals += [f"{s[c]:7.0f}/{s[c] / n:5.2f}" for c in cols[3:]]
        print(f"{kind:8s} " + " ".join(vals))
    slow = sorted(range(len(records)), key=lambda i: -records[i]["host"])[:8]
    print("slowest steps by host time (index, kind, reqs, tokens, host/launch/wait/span/idle ms):")
    for i in slow:
        r = records[i]
        print(f"  {i:5d} {r['kind']:6s} {r['reqs']:4d} {r['tokens']:5d}  {r['host'] * 1e3:7.1f} "
              f"{r['launch'] * 1e3:7.1f} {r['wait'] * 1e3:7.1f} {r['span']:7.1f} {r['idle']:7.1f}")


timed_run("cold (first run of the process)")
timed_run("warm (same requests again)")
