"""Apply a grammar's token bitmask to logits in one launch (GPU path of
folio.structured_output.masking): program (row, block of vocab) reads the block's int32 words
and sets the logits of tokens whose bit is 0 to -inf. Rows with every bit set are unchanged,
so unconstrained rows of a batch need no index list."""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _apply_bitmask_kernel(LOGITS, MASK, stride_l, stride_m, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = cols < V
        words = tl.load(MASK + row * stride_m + cols // 32, mask=in_vocab, other=-1)
        allowed = ((words >> (cols % 32)) & 1) != 0
        ptrs = LOGITS + row * stride_l + cols
        logits = tl.load(ptrs, mask=in_vocab)
        tl.store(ptrs, tl.where(allowed, logits, float("-inf")), mask=in_vocab)


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (any float dtype), bitmask [B, ceil(V/32)] int32 on the same device."""
    require_triton()
    B, V = logits.shape
    if bitmask.shape[0] != B or bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    block = 1024
    if B:
        _apply_bitmask_kernel[(B, triton.cdiv(V, block))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), V, BLOCK=block, num_warps=4)
