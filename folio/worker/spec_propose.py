"""What the worker's draft proposers (a draft model, an EAGLE head) read after a step, and the
one-token steps they chain.

A proposer's KV cache has the target's blocks and is addressed through the target's block
table; the scheduler allocates `num_speculative_tokens` slots past every step's tokens for the
positions a chain writes ahead (`Drafter.lookahead`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from folio.model.attention import AttentionMetadata
from folio.model.host_copy import device_tensor
from folio.worker.input_batch import InputBatch


@dataclass
class DraftInputs:
    """One finished step, as a proposer sees it. Row r of the flat batch holds token
    input_ids[r] at positions[r]; for each request of the step (in `req_ids` order) its
    newest known token follows row `last_rows[i]` (at position `last_positions[i]` + 1): the
    token sampled or kept by verification (its rejected drafts' rows lie beyond), or for a
    prefill chunk that samples nothing, the next prompt token."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor          # [T, H]: the target's final hidden states
    req_ids: list[str]
    last_rows: list[int]
    last_positions: list[int]
    next_tokens: list[int]
    drafting: list[bool]          # sampled this step: gets drafts


class DraftProposer(Protocol):
    def propose(self, inputs: DraftInputs, batch: InputBatch) -> dict[str, list[int]]:
        """Draft tokens for the requests that sampled (each at most k, all below
        max_model_len), having written this step's positions into the proposer's cache."""
        ...


@dataclass
class Drafting:
    """The requests that draft after a step: their indices into DraftInputs' lists, ids,
    batch rows, newest tokens' positions, and how many drafts each can take."""
    which: list[int]
    req_ids: list[str]
    rows: np.ndarray
    newest: np.ndarray
    steps: np.ndarray


def drafting_requests(inputs: DraftInputs, batch: InputBatch, k: int,
                      max_model_len: int) -> Drafting:
    which = [i for i, d in enumerate(inputs.drafting) if d]
    req_ids = [inputs.req_ids[i] for i in which]
    rows = np.asarray([batch.requests[rid].row for rid in req_ids], dtype=np.int64)
    newest = np.asarray([inputs.last_positions[i] + 1 for i in which], dtype=np.int64)
    return Drafting(which, req_ids, rows, newest, chain_lengths(k, max_model_len, newest))


def chain_lengths(k: int, max_model_len: int, newest_positions: np.ndarray) -> np.ndarray:
    """Drafts each request can take: a draft's position (newest + i) stays below
    max_model_len."""
    return np.minimum(k, max_model_len - 1 - newest_positions).clip(min=0)


def one_token_meta(batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                   block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of a step that writes one token per request (batch rows `rows`) at
    `positions`, reading every position before it."""
    table = batch.block_table[rows]
    blocks = positions // block_size
    if (blocks >= batch.num_blocks[rows]).any():
        raise RuntimeError("a draft position has no KV slot: the scheduler's lookahead did "
                           "not cover the proposer's steps")
    slots = table[np.arange(len(rows)), blocks].astype(np.int64) * block_size \
        + positions % block_size
    width = int(blocks.max()) + 1
    return AttentionMetadata(
        slot_mapping=device_tensor(slots.tolist(), device, torch.int64),
        query_start_loc=list(range(len(rows) + 1)), seq_lens=(positions + 1).tolist(),
        num_computed_tokens=positions.tolist(),
        block_tables=device_tensor(table[:, :width].astype(np.int64), device, torch.int64),
        block_size=block_size)


def gather_drafts(steps: list[tuple[np.ndarray, torch.Tensor]], req_ids: list[str],
                  device: torch.device) -> dict[str, list[int]]:
    """Each chain step's (indices into req_ids, tokens) into per-request lists, with one copy
    to the host."""
    if not steps:
        return {rid: [] for rid in req_ids}
    table = torch.full((len(req_ids), len(steps)), -1, dtype=torch.int64, device=device)
    for j, (active, tokens) in enumerate(steps):
        table[device_tensor(active.tolist(), device, torch.int64), j] = tokens
    return {rid: [t for t in row if t >= 0] for rid, row in zip(req_ids, table.tolist())}
