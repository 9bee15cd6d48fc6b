"""What the worker's draft proposers (a draft model, an EAGLE head) read after a step, and the
one-token steps they chain.

A proposer's KV cache has the target's blocks and is addressed through the target's block
table; the scheduler allocates `num_speculative_tokens` slots past every step's tokens for the
positions a chain writes ahead (`Drafter.lookahead`).

After a step where no request drafts (the adaptive draft length resting at k = 0) a proposer
keeps back the rows it would write into its cache (`DeferredWrites`) and writes them in one
prefill-like pass before the next step that drafts: on the CPU writing them every step cost
10-20 % of a plain step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

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
    next_tokens: torch.Tensor     # [len(req_ids)] int64 on the device: each newest token
    drafting: list[bool]          # sampled this step: gets drafts


class DraftProposer(Protocol):
    def propose(self, inputs: DraftInputs, batch: InputBatch) -> dict[str, list[int]]:
        """Draft tokens for the requests that sampled (each at most k, all below
        max_model_len), having written this step's positions into the proposer's cache (or,
        where none drafts, kept them back: DeferredWrites)."""
        ...

    def release(self, req_ids: Iterable[str], batch: InputBatch) -> None:
        """Requests leaving the batch (finished or preempted), told before `batch` forgets
        them: what the proposer kept back of them goes into its cache now."""
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


def chunk_meta(batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
               block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of a step that writes positions [starts[i], ends[i]) (at least one) of each
    request (batch rows `rows`), reading every position before them."""
    counts = ends - starts
    owner = np.repeat(np.arange(len(rows)), counts)
    query_start_loc = np.concatenate(([0], np.cumsum(counts)))
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[owner] + starts[owner]
    table = batch.block_table[rows]
    blocks = positions // block_size
    if (blocks >= batch.num_blocks[rows][owner]).any():
        raise RuntimeError("a proposer's position has no KV slot: the scheduler's lookahead "
                           "did not cover the proposer's steps")
    slots = table[owner, blocks].astype(np.int64) * block_size + positions % block_size
    width = int(blocks.max()) + 1
    return AttentionMetadata(
        slot_mapping=device_tensor(slots.tolist(), device, torch.int64),
        query_start_loc=query_start_loc.tolist(), seq_lens=ends.tolist(),
        num_computed_tokens=starts.tolist(),
        block_tables=device_tensor(table[:, :width].astype(np.int64), device, torch.int64),
        block_size=block_size)


def one_token_meta(batch: InputBatch, rows: np.ndarray, positions: np.ndarray,
                   block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of a step that writes one token per request (batch rows `rows`) at
    `positions`, reading every position before it."""
    return chunk_meta(batch, rows, positions, positions + 1, block_size, device)


# The most rows DeferredWrites keeps back: past it they go into the cache at once, so the kept
# target states stay small (1024 rows of a 4096-wide bfloat16 state: 8 MiB, an EAGLE-3 head's
# three streams 24 MiB) and a flush is no larger than a chunked-prefill step.
MAX_DEFERRED_ROWS = 1024

# (tokens, positions, the target's features or None, metadata) -> writes them into the cache
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, AttentionMetadata], None]


class DeferredWrites:
    """The rows a proposer would have written into its cache after steps where no request
    drafted, kept back and written by `flush` as one prefill-like pass: before the next step
    that drafts, when MAX_DEFERRED_ROWS are kept, and when a request with kept rows
    leaves the batch (`release`).

    Each request's kept rows are contiguous positions [start, end): every step of it goes
    through the proposer, and its rows past `last_rows` (rejected drafts, rewritten by later
    steps) are not kept. Kept tensors are copies: the step's may be views of buffers (CUDA
    graphs', the host step buffers) that the next step overwrites."""

    def __init__(self, write: CacheWrite, block_size: int, device: torch.device) -> None:
        self._write = write
        self.block_size = block_size
        self.device = device
        self._tokens: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []
        # per request (in order of arrival): its runs of rows (offset, count) in the kept
        # tensors' concatenation, and the positions [start, end) they hold
        self._rows: dict[str, list[tuple[int, int]]] = {}
        self._spans: dict[str, list[int]] = {}
        self.num_rows = 0

    def __contains__(self, req_id: str) -> bool:
        """Whether rows of the request are kept."""
        return req_id in self._spans

    def add(self, inputs: DraftInputs, tokens: torch.Tensor, features: torch.Tensor | None,
            batch: InputBatch) -> None:
        """Keep the step's rows (`tokens`: what the proposer takes at each row of the step,
        `features`: the target's state there, if it takes one); flush past the bound."""
        qsl = inputs.meta.query_start_loc
        offset = self.num_rows
        for i, rid in enumerate(inputs.req_ids):
            n = inputs.last_rows[i] + 1 - qsl[i]
            end = inputs.last_positions[i] + 1
            span = self._spans.setdefault(rid, [end - n, end - n])
            if span[1] != end - n:
                raise RuntimeError(f"request {rid}'s kept rows skip positions {span[1]} .. "
                                   f"{end - n - 1}")
            span[1] = end
            self._rows.setdefault(rid, []).append((offset, n))
            offset += n
        index = None   # every row kept (no drafts rejected): no index to the device
        if offset - self.num_rows < tokens.shape[0]:
            index = device_tensor(np.concatenate(
                [np.arange(qsl[i], last + 1) for i, last in enumerate(inputs.last_rows)]
            ).tolist(), self.device, torch.int64)
        self._tokens.append(_copy_rows(tokens, index))
        self._positions.append(_copy_rows(inputs.positions, index))
        if features is not None:
            self._features.append(_copy_rows(features, index))
        self.num_rows = offset
        if self.num_rows >= MAX_DEFERRED_ROWS:
            self.flush(batch)

    def release(self, req_ids: Iterable[str], batch: InputBatch) -> None:
        """Requests leaving the batch (finished, preempted), told while `batch` still holds
        their block tables: their kept rows go in now, so none is kept past them (a preempted
        request recomputed under the same id starts a new run of positions). The scheduler
        may have given their blocks to a request of this very step, but that one writes them
        only later, in the step's pass. Written rather than dropped: the prefix cache may hand
        the blocks to a later request, which then reads these entries."""
        if any(rid in self for rid in req_ids):
            self.flush(batch)

    def flush(self, batch: InputBatch) -> None:
        """Write the kept rows, each request's as one chunk reading its cache before it."""
        if not self.num_rows:
            return
        req_ids = list(self._spans)
        order = np.concatenate([np.arange(offset, offset + n) for rid in req_ids
                                for offset, n in self._rows[rid]])
        spans = np.asarray([self._spans[rid] for rid in req_ids], dtype=np.int64)
        batch_rows = np.asarray([batch.requests[rid].row for rid in req_ids], dtype=np.int64)
        meta = chunk_meta(batch, batch_rows, spans[:, 0], spans[:, 1], self.block_size,
                          self.device)
        tokens = torch.cat(self._tokens)
        positions = torch.cat(self._positions)
        features = torch.cat(self._features) if self._features else None
        if not np.array_equal(order, np.arange(self.num_rows)):
            # several requests over several steps: each request's rows together
            index = device_tensor(order.tolist(), self.device, torch.int64)
            tokens, positions = tokens[index], positions[index]
            features = features[index] if features is not None else None
        self._tokens, self._positions, self._features = [], [], []
        self._rows, self._spans, self.num_rows = {}, {}, 0
        self._write(tokens, positions, features, meta)


def _copy_rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t.clone() if index is None else t[index]


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
