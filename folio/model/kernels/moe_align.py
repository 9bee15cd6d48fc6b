"""The MoE block alignment (folio.model.moe.dispatch.align_to_blocks) in one Triton launch, for
decode-sized batches: the torch form is about fifteen small kernels (counts, cumsum, argsort,
searchsorted...), which at batch 1 cost several times the expert GEMMs' own bytes floor.

One program holds every (token, slot) pair: it counts the pairs per expert, pads each expert's
run to the row block, ranks each pair among the earlier pairs of its expert (a stable order,
the same as the torch form's stable argsort), scatters the pair indices to their padded rows,
and names each row block's expert. The pairwise ranking is quadratic in the pairs, so this
form serves up to MAX_PAIRS of them; larger batches keep the torch form, whose launches their
GEMMs amortize.
"""
from __future__ import annotations

import torch

from folio.model.kernels._common import HAS_TRITON, next_pow2, tl, triton

# The most pairs the one-program form takes (batch 32 at top 8).
MAX_PAIRS = 256

if HAS_TRITON:

    @triton.jit
    def _align_kernel(IDS, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, num_experts, max_rows,
                      max_blocks, P: tl.constexpr, E: tl.constexpr, R: tl.constexpr,
                      NB: tl.constexpr, BLOCK_M: tl.constexpr):
        p = tl.arange(0, P)
        valid = p < num_pairs
        expert = tl.load(IDS + p, mask=valid, other=E).to(tl.int32)   # E: no expert
        ex = tl.arange(0, E)
        counts = tl.sum((expert[None, :] == ex[:, None]).to(tl.int32), axis=1)       # [E]
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, axis=0)
        padded_start = padded_end - padded
        earlier = (expert[:, None] == expert[None, :]) & (p[None, :] < p[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)                                   # [P]
        start = tl.sum(tl.where(expert[:, None] == ex[None, :], padded_start[None, :], 0),
                       axis=1)
        rows = tl.arange(0, R)
        tl.store(SORTED_PAIRS + rows, num_pairs, mask=rows < max_rows)
        tl.debug_barrier()   # the padding fill lands before the pairs' own rows
        tl.store(SORTED_PAIRS + start + rank, p.to(tl.int64), mask=valid)
        blocks = tl.arange(0, NB)
        first_row = blocks * BLOCK_M
        # the expert whose padded run holds the block's first row: how many runs end at or
        # before it (torch's searchsorted(..., right=True)); past the last run, -1
        ended = (padded_end[None, :] <= first_row[:, None]) & (ex[None, :] < num_experts)
        owner = tl.sum(ended.to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(BLOCK_EXPERT + blocks, owner.to(tl.int64), mask=blocks < max_blocks)


def align_small(flat_ids: torch.Tensor, num_experts: int, block_m: int, max_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows], block_expert [ceil(max_rows / block_m)]), both int64, for at
    most MAX_PAIRS pairs `flat_ids` (each an expert id), in one launch."""
    pairs = flat_ids.numel()
    if pairs > MAX_PAIRS:
        raise ValueError(f"align_small takes at most {MAX_PAIRS} pairs, got {pairs}")
    max_blocks = -(-max_rows // block_m)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int64, device=flat_ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int64, device=flat_ids.device)
    _align_kernel[(1,)](
        flat_ids, sorted_pairs, block_expert, pairs, num_experts, max_rows, max_blocks,
        P=next_pow2(max(pairs, 2)), E=next_pow2(max(num_experts, 2)),
        R=next_pow2(max(max_rows, 2)), NB=next_pow2(max(max_blocks, 2)), BLOCK_M=block_m,
        num_warps=4)
    return sorted_pairs, block_expert
