"""GPU helper: which kernels one batch-1 decode step of the Qwen3-0.6B shape launches, how many
of each and their device time (torch.profiler, CUPTI), eager and with CUDA graphs.
For the device tool: python tools/gpu_kernel_census.py [OUTPUT_LEN] [--config C]
[--quantization fp8 | --random-quantization w4a16] [--graphs-only]. Under programmatic
dependent launch (KernelConfig.pdl, on by default on Hopper) a kernel's CUPTI time includes
its wait for the kernel before it, so per-kernel times there add up to more than the step;
run with FOLIO_PDL=0 for a kernel-by-kernel account. The "exposed" column is PDL-proof: each
kernel is charged only for the time its end moved the device's busy front forward (its end
minus the latest end before it, never its overlap with the kernel it waited on), and the
device's idle time between kernels is listed apart, so the column sums to the step."""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from folio import LLM, SamplingParams
from folio.bench.random_model import build_random_model_in_child

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_len", type=int, nargs="?", default=64)
    parser.add_argument("--config", default="qwen3-0.6b")
    parser.add_argument("--quantization", default=None, help="on-load quantization, e.g. fp8")
    parser.add_argument("--random-quantization", default=None,
                        help="a random pre-quantized checkpoint, e.g. w4a16")
    parser.add_argument("--graphs-only", action="store_true", help="skip the eager census")
    args = parser.parse_args()
    output_len = args.output_len
    # in a child, so the builder's memory and CUDA context stay out of the profiled process
    path = build_random_model_in_child(args.config, None, args.random_quantization)["path"]
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for eager in ((False,) if args.graphs_only else (True, False)):
        llm = LLM(path, dtype="bfloat16", max_model_len=2048, max_num_seqs=8, enforce_eager=eager,
                  quantization=args.quantization)
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize()
        counts: dict[str, int] = collections.Counter()
        times: dict[str, float] = collections.Counter()
        exposed: dict[str, float] = collections.Counter()
        kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name[:90])
                         for ev in prof.events()
                         if ev.device_type == torch.autograd.DeviceType.CUDA)
        front = kernels[0][0] if kernels else 0.0
        idle = 0.0
        for start, end, name in kernels:
            counts[name] += 1
            times[name] += end - start
            idle += max(0.0, start - front)
            exposed[name] += max(0.0, end - max(front, start))
            front = max(front, end)
        total_n, total_t = sum(counts.values()), sum(times.values())
        print(f"=== eager={eager}: {total_n / output_len:.1f} kernels/token, "
              f"{total_t / output_len:.1f} us GPU/token, exposed "
              f"{sum(exposed.values()) / output_len:.1f} + idle {idle / output_len:.1f} us/token")
        for name, n in sorted(counts.items(), key=lambda kv: -exposed[kv[0]]):
            print(f"{n / output_len:8.2f}/tok {times[name] / n:8.2f} us  "
                  f"{times[name] / output_len:8.1f} us/tok  exposed "
                  f"{exposed[name] / output_len:8.1f} us/tok  {name}")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":   # the model is built in a spawned child
    main()
