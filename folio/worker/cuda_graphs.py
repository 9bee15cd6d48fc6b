"""CUDA graphs for pure-decode steps.

A decode step of a small model is dominated by launch overhead: a few hundred tiny kernels, each
costing more on the host than on the GPU. Capturing the forward pass once per batch size and
replaying it turns those launches into one.

A graph replays fixed kernels on fixed addresses, so everything the forward pass reads lives in
static device buffers sized for the largest batch (`max_num_seqs` rows, `ceil(max_model_len /
block_size)` block-table columns). Each step copies its values into them and replays the graph of
the smallest captured size that fits; the rows past the real batch are padding that:
  * write nothing to the KV cache (slot -1, which `reshape_and_cache` skips), and
  * attend over one key of block 0 (seq_len 1): the cache is zero-initialised and only ever holds
    finite values, so the padding rows stay finite and never touch a real row (every op of the
    model except attention is row-wise, and attention reads only its own row's context).

The attention backend must not derive anything from the step on the host while capturing: the
runner puts a `TritonStepTensors` built on the static buffers into the step metadata's cache
(so every layer reuses it), with `max_seq_len = max_model_len` and a fixed split count per batch
size. That split count is chosen for the longest possible context; shorter contexts leave some
splits empty, which the merge kernel weighs as zero.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import numpy as np
import torch

from folio.core.scheduler import ScheduledRequest
from folio.model.attention import AttentionMetadata
from folio.model.attention.triton_backend import (STEP_CACHE_KEY, TritonPagedAttention,
                                                  TritonStepTensors)
from folio.model.decoder import DecoderLM
from folio.model.layers import Attention

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, and max_num_seqs itself so
    that every decode batch the scheduler can form has a graph."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def triton_backend_of(model: DecoderLM) -> TritonPagedAttention | None:
    """The model's attention backend if every layer uses the Triton one (the only backend with
    a capture-safe static path), else None."""
    backends = {id(m.backend): m.backend for m in model.modules() if isinstance(m, Attention)}
    if not backends or not all(isinstance(b, TritonPagedAttention) for b in backends.values()):
        return None
    return next(iter(backends.values()))


class DecodeGraphRunner:
    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        backend = triton_backend_of(model)
        assert backend is not None, "CUDA graphs need the Triton attention backend"
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        n, w = self.max_batch, self.max_blocks
        dtype = next(model.parameters()).dtype

        # Device buffers the graphs read and write, at fixed addresses for their lifetime.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, w), dtype=torch.int32, device=device)
        # Decode: request i owns query row i.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, model.spec.hidden_size), dtype=dtype, device=device)

        # Pinned host mirrors, filled through numpy views, copied with non_blocking=True.
        pin = dict(device="cpu", pin_memory=True)
        self._h_ids = torch.zeros(n, dtype=torch.int64, **pin)
        self._h_pos = torch.zeros(n, dtype=torch.int64, **pin)
        self._h_slots = torch.zeros(n, dtype=torch.int64, **pin)
        self._h_seq = torch.zeros(n, dtype=torch.int32, **pin)
        self._h_bt = torch.zeros((n, w), dtype=torch.int32, **pin)
        self._stager = DecodeInputStager(self._h_ids.numpy(), self._h_pos.numpy(),
                                         self._h_slots.numpy(), self._h_seq.numpy(),
                                         self._h_bt.numpy(), block_size)
        # Recorded after each step's copies: the host buffers are not rewritten until the
        # previous copies out of them have finished.
        self._copied = torch.cuda.Event()
        self._copied_pending = False

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0
        self.replayed_sizes: set[int] = set()
        self.capture_seconds = 0.0

    # ---- capture --------------------------------------------------------------------------

    def _static_metadata(self, bs: int) -> AttentionMetadata:
        st = TritonStepTensors(
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            max_query_len=1, max_seq_len=self.max_model_len, all_decode=True)
        kv_heads = self.kv_caches[0].shape[3]
        st.num_splits = self.backend.num_splits(st, kv_heads, self.device)
        # The host-side lists are never read on this path (the backend finds its tensors in
        # the cache); they only keep the metadata well formed.
        meta = AttentionMetadata(
            slot_mapping=st.slot_mapping, query_start_loc=list(range(bs + 1)),
            seq_lens=[1] * bs, num_computed_tokens=[0] * bs, block_tables=st.block_tables,
            block_size=self.block_size)
        meta.cache[STEP_CACHE_KEY] = st
        return meta

    def _forward(self, bs: int) -> None:
        out = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches,
                         self._metas[bs])
        self.hidden[:bs].copy_(out)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # The buffers hold padding values here (slot -1, seq_len 1), so warm-up and capture
        # write nothing to the KV cache. Largest first: later, smaller graphs reuse the pool
        # memory the larger ones reserved.
        for bs in reversed(self.sizes):
            self._metas[bs] = self._static_metadata(bs)
            # Eager runs first: Triton autotunes and compiles on first call per key, which
            # cannot happen inside a capture.
            for _ in range(2):
                self._forward(bs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for decode (batch sizes %s) in %.1f s",
                    len(self.graphs), self.sizes, self.capture_seconds)

    # ---- replay ---------------------------------------------------------------------------

    def can_run(self, scheduled: list[ScheduledRequest]) -> bool:
        """A pure-decode step (one new token per request) that fits the static buffers."""
        return (0 < len(scheduled) <= self.max_batch
                and all(s.num_new_tokens == 1 and len(s.block_ids) <= self.max_blocks
                        for s in scheduled))

    def run(self, scheduled: list[ScheduledRequest],
            fill_pending: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Replay the graph for this step; returns the final hidden states [B, hidden], a view
        of the static output buffer (valid until the next replay). `fill_pending` writes the
        inputs still being sampled by the previous step into the static input ids, on the
        device, before the replay."""
        B = len(scheduled)
        bs = self.sizes[bisect.bisect_left(self.sizes, B)]
        if self._copied_pending:
            self._copied.synchronize()
        self._stager.fill(scheduled, bs)
        for dst, src in ((self.input_ids, self._h_ids), (self.positions, self._h_pos),
                         (self.slot_mapping, self._h_slots), (self.seq_lens, self._h_seq),
                         (self.block_tables, self._h_bt)):
            dst[:bs].copy_(src[:bs], non_blocking=True)
        self._copied.record()
        self._copied_pending = True
        if fill_pending is not None:
            fill_pending(self.input_ids)
        self.graphs[bs].replay()
        self.num_replays += 1
        self.replayed_sizes.add(bs)
        return self.hidden[:B]


class BlockTableRows:
    """Keeps a host block-table buffer's rows between steps and rewrites only what changed.

    Rows are the costly part of staging a step (a Python list into a numpy row, per request per
    step: about a millisecond at 256 requests on a small host), and they barely change between
    steps: a row is rewritten only when another request's block list lands on it, and only the
    new tail when the same list grew. A row is matched to a list by identity: the KV cache
    manager hands out a live list per request and drops it on free, and this class holds a
    reference, so an identity cannot be reused by another list while it is cached. The buffer
    must keep its values between steps (the caller waits for the previous step's copies out of
    it before writing)."""

    def __init__(self, block_tables: np.ndarray) -> None:
        self.bt = block_tables
        # Per row: [the block-id list written there, how many of its entries are written].
        self._rows: list[list | None] = [None] * block_tables.shape[0]

    def write(self, i: int, blocks: list[int]) -> None:
        """Row i holds `blocks` from column 0; columns past them keep stale (valid) ids, which
        the kernels never read (they stop at ceil(seq_len / block_size))."""
        n = len(blocks)
        row = self._rows[i]
        if row is None or row[0] is not blocks:
            self.bt[i, :n] = blocks
            self._rows[i] = [blocks, n]
        elif row[1] != n:
            self.bt[i, row[1]:n] = blocks[row[1]:]
            row[1] = n

    def forget(self, start: int, stop: int) -> None:
        """Rows [start, stop) were overwritten by something else (padding)."""
        for j in range(start, stop):
            self._rows[j] = None


class DecodeInputStager:
    """Writes a decode step's inputs into the host mirrors of the graph's static buffers:
    row i = scheduled request i, rows past the batch up to the padded size are padding.
    Block-table rows are kept between steps (`BlockTableRows`)."""

    def __init__(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, seq: np.ndarray,
                 block_tables: np.ndarray, block_size: int) -> None:
        self.ids, self.pos, self.slots, self.seq, self.bt = ids, pos, slots, seq, block_tables
        self.block_size = block_size
        self._tables = BlockTableRows(block_tables)

    def fill(self, scheduled: list[ScheduledRequest], padded: int) -> None:
        ids, pos, slots, seq, bt = self.ids, self.pos, self.slots, self.seq, self.bt
        block = self.block_size
        write_row = self._tables.write
        for i, item in enumerate(scheduled):
            p = item.num_computed_tokens
            blocks = item.block_ids
            known = item.request.all_token_ids
            ids[i] = known[p] if p < len(known) else 0  # else: filled on the device
            pos[i] = p
            slots[i] = blocks[p // block] * block + p % block
            seq[i] = p + 1
            write_row(i, blocks)
        B = len(scheduled)
        ids[B:padded] = 0
        pos[B:padded] = 0
        slots[B:padded] = -1
        seq[B:padded] = 1
        bt[B:padded, 0] = 0
        self._tables.forget(B, padded)
