"""Token permutation for the expert GEMMs: the T x k (token, slot) pairs sorted by expert, so
that each expert multiplies one contiguous run of rows.

Two layouts:
- `sort_by_expert` (the CPU path): the pairs' order and per-expert counts (read on the host);
- `align_to_blocks` (the Triton kernel): every expert's run padded to a multiple of the
  kernel's BLOCK_M rows, with the expert of each block. Device ops only, and sized by an upper
  bound rather than by the counts, so no host sync and the shapes are fixed for a given T (a
  CUDA graph can capture it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.model.kernels._common import HAS_TRITON, INTERPRET
from folio.model.kernels.moe_align import MAX_PAIRS, align_small


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """topk_ids [T, k] -> (order [T*k]: flat (token, slot) indices sorted by expert, stable;
    counts: rows per expert, a host list)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.tolist()


@dataclass
class BlockAlignment:
    # [max_rows] int64: the flat (token, slot) index at each padded row, `num_pairs` (= T*k,
    # out of range) on padding rows
    sorted_pairs: torch.Tensor
    # [max_blocks] int64: the expert of each BLOCK_M-row block, -1 past the last used block
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the padded layout can need: every pair, plus up to block_m - 1 padding rows for
    each expert that has any (at most min(E, pairs) of them)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    if pairs <= MAX_PAIRS and HAS_TRITON and (flat.is_cuda or INTERPRET):
        # decode-sized: one launch instead of the fifteen below (kernels/moe_align.py)
        sorted_pairs, block_expert = align_small(
            flat, num_experts, block_m, max_padded_rows(pairs, num_experts, block_m))
        return BlockAlignment(sorted_pairs, block_expert, pairs, block_m)
    # scatter_add, not bincount: bincount on CUDA reads the largest id back to the host (a
    # sync per MoE layer, and no CUDA-graph capture)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_expert]
    dest = padded_start[sorted_expert] + rank
    max_rows = max_padded_rows(pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_rows,), pairs, dtype=torch.int64, device=device)
    sorted_pairs[dest] = order
    max_blocks = -(-max_rows // block_m)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    # blocks past the last expert's padded run do no work
    block_expert = torch.where(block_expert < num_experts, block_expert,
                               torch.full_like(block_expert, -1))
    return BlockAlignment(sorted_pairs, block_expert, pairs, block_m)
