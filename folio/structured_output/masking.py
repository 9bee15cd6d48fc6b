"""Applying a token bitmask to logits, the same for every grammar backend.

Bit b of int32 word w in a row allows token id 32*w + b (the layout xgrammar and llguidance
both fill). On CUDA one Triton launch masks the whole batch (folio.model.kernels.bitmask); on
the CPU a few torch ops mask the constrained rows only.
"""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size], True = allowed."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: in the given rows of logits [batch, vocab], disallowed tokens get -inf.
    bitmask is [batch, words]; it may live on the CPU. On CUDA (Triton available) the whole
    bitmask goes over in one copy and one kernel launch applies it — so rows not in `rows`
    must be all ones (allowed), as StructuredOutputManager.grammar_bitmask leaves them; a chain
    of small eager ops here cost a quarter of a millisecond of launches per step."""
    if not rows:
        return
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask width {bitmask.shape[1]} too small for vocab {vocab}")
    if logits.is_cuda and logits.stride(1) == 1:
        from folio.model.kernels._common import HAS_TRITON
        if HAS_TRITON:
            from folio.model.kernels.bitmask import apply_bitmask_inplace
            apply_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
            return
    index = torch.tensor(rows, dtype=torch.long)
    selected = bitmask.index_select(0, index).to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(selected, vocab)
    index = index.to(logits.device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
