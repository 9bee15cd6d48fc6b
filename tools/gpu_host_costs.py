"""GPU helper (issue 17's verify turn-around): the host's microseconds per call of the torch
operations a step's exposed turn-around makes, each alone, against alternatives:

- the step inputs' one copy (`StepBuffers.copy_to`): slicing both arenas and `copy_` from
  torch-pinned memory (which also records an event in torch's host allocator), against the
  same copy of views made once, and from memory pinned with cudaHostRegister (not the host
  allocator's, so no event of its own);
- the copy's event record (`copies_queued`): `Event.record()` (which asks for the current
  stream each time) against `record(stream)` with the stream kept;
- the kept tokens' copy to the host (`to_host_async`): a fresh pinned tensor each step
  against one kept buffer, and `torch.cuda.Event()` made each step against one kept.

python tools/gpu_host_costs.py [--iters 2000]
"""
from __future__ import annotations

import argparse
import time

import torch


def _per_call_us(fn, iters: int) -> float:
    """Median over 5 rounds of the host time per call; the device is synchronized between
    rounds (not inside one), so the queue stays short."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
    rounds.sort()
    return rounds[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    n, end = 1 << 20, 4096           # an arena of 1 MiB, a step's first 4 KiB
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    plain = torch.empty(n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    registered = int(cudart.cudaHostRegister(plain.data_ptr(), n, 0)) == 0
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst_view, src_view = device[:end], pinned[:end]
    plain_view = plain[:end]
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    tokens = torch.zeros(8, dtype=torch.int64, device="cuda")
    kept = torch.empty(8, dtype=torch.int64, pin_memory=True)

    cases = {
        "copy_: slice both arenas, torch-pinned source (today)":
            lambda: device[:end].copy_(pinned[:end], non_blocking=True),
        "copy_: views made once, torch-pinned source":
            lambda: dst_view.copy_(src_view, non_blocking=True),
        "torch.empty(pin_memory) only (1 KiB)":
            lambda: torch.empty(1024, dtype=torch.uint8, pin_memory=True),
        "Event.record() (today)": lambda: event.record(),
        "Event.record(kept stream)": lambda: event.record(stream),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.cuda.Event() + record() (a step's output, today)":
            lambda: torch.cuda.Event().record(),
        "to host: fresh pinned tensor + copy_ (to_host_async, today)":
            lambda: torch.empty(tokens.shape, dtype=tokens.dtype,
                                pin_memory=True).copy_(tokens, non_blocking=True),
        "to host: kept pinned buffer copy_": lambda: kept.copy_(tokens, non_blocking=True),
    }
    if registered:
        cases["copy_: views made once, cudaHostRegister-ed source"] = (
            lambda: dst_view.copy_(plain_view, non_blocking=True))
    else:
        print("cudaHostRegister failed: that case is left out")
    for name, fn in cases.items():
        fn()
        print(f"host cost {_per_call_us(fn, args.iters):8.2f} us/call  {name}")
    if registered:
        cudart.cudaHostUnregister(plain.data_ptr())


if __name__ == "__main__":
    main()
