"""Does an attention backend pay per new sequence length? Times three back-to-back calls of
torch's SDPA (cuDNN, then FlashAttention-2) at lengths it has not seen, Llama-3-8B heads,
causal, bf16: cuDNN builds an execution plan per length on its first call (why
folio/model/attention/dense_prefill.py pads to a few lengths and plans them at start-up).

    python tools/gpu_probe_cudnn_plans.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, KVH, D = 32, 8, 128


def three_calls_ms(n: int, backend) -> list[float]:
    q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KVH, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        three_calls_ms(4096, backend)   # the backend's own first-use costs
        for n in (2048, 2049, 2050, 2100, 3000, 3001, 5000, 8000, 8001):
            times = three_calls_ms(n, backend)
            print(f"{backend} {n}: " + " ".join(f"{t:.2f}" for t in times)
                  + " ms (first, second, third)")


if __name__ == "__main__":
    main()
