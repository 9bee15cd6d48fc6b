"""Long fresh prefills through torch's fused attention (cuDNN, else FlashAttention-2).

A request whose context starts in this step (nothing cached before it) attends only over its
own new keys and values, which the layer holds contiguously: it needs no page tables. For long
such prompts the paged Triton kernel reached 340 TFLOP/s on the H200 where cuDNN's fused
attention reached 579 (tools/gpu_bench_attention.py, 8,000-token causal prompt, Llama-3-8B
heads; docs/benchmarks.md) -- a third of an 8k prompt's TTFT was that kernel. So the Triton
backend hands such requests (from DENSE_PREFILL_MIN_TOKENS tokens) to torch's scaled dot
product attention and the rest of the step to its own kernel, as vLLM hands prefills to
FlashAttention.

cuDNN builds an execution plan for each sequence length it meets (53-60 ms each on the H200,
tools/gpu_probe_cudnn_plans.py), so a request's tokens are padded to one of a few lengths
(`padded_length`: at most eight per doubling) -- harmless for causal attention, whose real rows
never see the later padding -- and the model runner builds the plans of every padded length up
to the step budget at start-up (`warm_up`).

Only eager steps take this path (the shapes are the step's own, which a captured CUDA graph
cannot follow); the model runner runs a step with such a request eagerly, where its GPU time
hides the launches. Layers it does not fit (sliding windows, soft-capped logits, sinks, an
FP8 cache whose quantized keys the paged path would read, heads wider than 256) keep the
paged kernel.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# From this many query tokens a fresh prefill's attention goes to torch's fused kernel. The
# attention's share of a prefill grows with its length (cuDNN's kernel was 1.64x the paged one
# at 8,000 tokens), while the step's other costs do not: below this a step runs eagerly
# (without its captured graph) for too little gain; the two kernels were compared at 8,000
# tokens only, so the bar stays well inside the measured range's half.
DENSE_PREFILL_MIN_TOKENS = 4096

_MAX_HEAD_DIM = 256
# Padded lengths: multiples of an eighth of the length's power of two, and of at least this.
_MIN_PAD_STEP = 256


def padded_length(n: int) -> int:
    """n rounded up to the next padded length: a multiple of max(256, 2^floor(log2 n) / 8),
    so at most 12.5 % longer, and eight lengths per doubling."""
    step = max(_MIN_PAD_STEP, (1 << (max(n, 1).bit_length() - 1)) // 8)
    return -(-n // step) * step


def padded_lengths(max_tokens: int) -> list[int]:
    """Every padded length a dense request of at most `max_tokens` tokens can take."""
    out, n = [], padded_length(DENSE_PREFILL_MIN_TOKENS)
    top = padded_length(max_tokens)
    while n <= top:
        out.append(n)
        n = padded_length(n + 1)
    return out


def layer_supported(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor, *,
                    sliding_window: int | None, logits_soft_cap: float | None,
                    sinks: torch.Tensor | None) -> bool:
    """Whether this layer's attention may take the dense path: plain causal softmax over
    16-bit heads of at most 256 dims, and a cache in the query's dtype (so that what the paged
    path would read back equals the fresh keys)."""
    d = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and kv_cache.dtype == query.dtype and key.shape[-1] == d
            and d <= _MAX_HEAD_DIM and d % 8 == 0
            and not (sliding_window is not None and sliding_window > 0)
            and logits_soft_cap is None and sinks is None)


def _backends() -> tuple:
    """In priority order: cuDNN's fused kernel, FlashAttention-2, then torch's other kernels
    (a shape or build the first two refuse still computes, slowly; the CPU tests run here)."""
    from torch.nn.attention import SDPBackend
    return (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """One request's causal self-attention: query [n, H, D], key/value [n, KVH, D] (the
    request's own tokens, position 0 first) -> [n, H, D], written into `out` when given, else
    the fused kernel's own output (token-major where it lays it out so: no copy). Query head h
    reads KV head h // (H // KVH), as the paged kernels do."""
    from torch.nn.attention import sdpa_kernel
    n = query.shape[0]
    pad = padded_length(n) - n
    if pad:
        # zeros, not garbage: a NaN in a masked-out key could still poison a sum
        query, key, value = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (query, key, value))
    # [1, heads, n, D] views of the token-major tensors. Grouped heads are read in place
    # (enable_gqa); widening K/V first made the call 18 % slower.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    with sdpa_kernel(list(_backends()), set_priority=True):
        res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=key.shape[1] != query.shape[1])
    res = res[0].transpose(0, 1)[:n]
    return res if out is None else out.copy_(res)


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
            dtype: torch.dtype, device: torch.device, max_tokens: int) -> int:
    """Build the fused kernel's plans for every padded length up to `max_tokens` at these
    head counts (one call each on zeros). Returns how many lengths were run."""
    lengths = padded_lengths(max_tokens) if max_tokens >= DENSE_PREFILL_MIN_TOKENS else []
    for n in lengths:
        q = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        kv = torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device)
        causal_attention(q, kv, kv, scale)
    return len(lengths)
