"""CUDA graphs for mixed steps: any step that is not pure decode (prefill chunks, with or without
decodes beside them), captured at a ladder of padded token counts.

Run eagerly, such a step is a few hundred kernel launches from Python (about 15 ms of host time
for a 28-layer model on the lent H200's host), while its GPU work can be a few milliseconds:
with chunked prefill the GPU mostly waits. The varlen attention kernel needs nothing from the
host but its grid, and its grid has a bound that depends only on the token count and the
number of request slots (`triton_kernels.paged_attention_varlen`), so the whole forward pass
can be captured, attention included (what vLLM calls a FULL graph for its Triton backend).

Static buffers, sized for the largest captured token count N and R = max_num_seqs + 1 request
slots:
  * tokens [0, T) are the step's, [T, n) padding up to the captured size n: slot -1 (no cache
    write), position 0;
  * request slots [0, B) are the step's; slot B is a dummy request that owns the padding
    tokens, a fresh prefill of n - T tokens that reads only its own causal context through
    whatever valid block ids its block-table row holds (the cache only ever holds finite
    values, so the padding rows stay finite); slots past B have no query tokens and return at
    once.
Every op of the model but attention is row-wise, and attention reads only its own request's
context, so padding never touches a real row.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from folio.core.scheduler import ScheduledRequest
from folio.model.attention import AttentionMetadata
from folio.model.attention.triton_backend import STEP_CACHE_KEY, TritonStepTensors
from folio.model.decoder import DecoderLM
from folio.worker.cuda_graphs import BlockTableRows, triton_backend_of

logger = logging.getLogger(__name__)

# Called with (the static input-ids tensor, flat token positions whose id is still being
# sampled by the step in flight, the scheduled index of each): writes those ids on the device.
FillPending = Callable[[torch.Tensor, list[int], list[int]], None]


def mixed_capture_sizes(max_num_tokens: int) -> list[int]:
    """Token counts to capture: powers of two from 16 to 512, then even steps of about an
    eighth of the budget (a multiple of 256), and the budget itself. Most mixed steps under
    chunked prefill fill the budget, so the coarse steps above 512 cost little padding."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < max_num_tokens]
    step = max(512, -(-max_num_tokens // 8 // 256) * 256)
    sizes += [s for s in range(step, max_num_tokens, step) if s > 512]
    sizes.append(max_num_tokens)
    return sizes


@dataclass
class StagedMixedStep:
    num_tokens: int                # T, the step's real tokens
    query_start_loc: list[int]     # B + 1 entries, the real requests only
    pending_dst: list[int]         # flat positions whose input is sampled by the step in flight
    pending_req: list[int]         # the scheduled index of each


class MixedInputStager:
    """Writes a mixed step's inputs into numpy views of the static buffers' host mirrors, with
    the padding described in the module docstring. Block-table rows are kept between steps."""

    def __init__(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, qsl: np.ndarray,
                 seq: np.ndarray, block_tables: np.ndarray, block_size: int) -> None:
        self.ids, self.pos, self.slots = ids, pos, slots
        self.qsl, self.seq, self.bt = qsl, seq, block_tables
        self.block_size = block_size
        self._tables = BlockTableRows(block_tables)

    def fill(self, scheduled: list[ScheduledRequest], padded: int) -> StagedMixedStep:
        B = len(scheduled)
        counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, B)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, B)
        qsl = np.zeros(B + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        T = int(qsl[-1])
        assert T <= padded and B + 1 <= len(self.seq)
        flat: list[int] = []
        pending_dst: list[int] = []
        pending_req: list[int] = []
        write_row = self._tables.write
        for i, item in enumerate(scheduled):
            known = item.token_ids
            flat.extend(known)
            if len(known) < item.num_new_tokens:
                # The last input is the token the step in flight is sampling.
                pending_dst.append(len(flat))
                pending_req.append(i)
                flat.append(0)
            write_row(i, item.block_ids)
        ids, pos, slots = self.ids, self.pos, self.slots
        ids[:T] = flat
        ids[T:padded] = 0
        req_of = np.repeat(np.arange(B), counts)
        positions = starts[req_of] + (np.arange(T) - qsl[:-1][req_of])
        pos[:T] = positions
        pos[T:padded] = 0
        block = self.block_size
        slots[:T] = self.bt[req_of, positions // block] * block + positions % block
        slots[T:padded] = -1
        self.qsl[:B + 1] = qsl
        self.qsl[B + 1:] = padded       # slot B (dummy) owns [T, padded); later slots are empty
        self.seq[:B] = starts + counts
        self.seq[B] = padded - T
        self.seq[B + 1:] = 0
        return StagedMixedStep(T, qsl.tolist(), pending_dst, pending_req)


class MixedGraphRunner:
    """Captures the forward pass of mixed steps at `mixed_capture_sizes` token counts and
    replays the smallest that fits. Without `capture()` (or on the CPU), `run` executes the
    same padded static path eagerly, which is how the padding is tested off the GPU."""

    def __init__(self, model: DecoderLM, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_num_seqs: int, max_model_len: int, max_num_tokens: int,
                 device: torch.device) -> None:
        backend = triton_backend_of(model)
        assert backend is not None, "mixed-step graphs need the Triton attention backend"
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.sizes = mixed_capture_sizes(max_num_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_reqs = max_num_seqs
        slots = max_num_seqs + 1  # + the dummy request of the padding tokens
        # Wide enough for the longest request and for the dummy's longest padding run.
        self.max_blocks = max(-(-max_model_len // block_size), -(-self.max_tokens // block_size))
        n, w = self.max_tokens, self.max_blocks
        dtype = next(model.parameters()).dtype

        def buffer(shape, dtype_, fill=0):
            return torch.full(shape, fill, dtype=dtype_, device=device)

        self.input_ids = buffer((n,), torch.int64)
        self.positions = buffer((n,), torch.int64)
        self.slot_mapping = buffer((n,), torch.int64, -1)
        self.query_start_loc = buffer((slots + 1,), torch.int32)
        self.seq_lens = buffer((slots,), torch.int32)
        self.block_tables = buffer((slots, w), torch.int32)
        self.hidden = buffer((n, model.spec.hidden_size), dtype)

        pin = device.type == "cuda"
        self._host = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)
                      for name, t in self._device_buffers().items()}
        h = {name: t.numpy() for name, t in self._host.items()}
        self._stager = MixedInputStager(h["input_ids"], h["positions"], h["slot_mapping"],
                                        h["query_start_loc"], h["seq_lens"], h["block_tables"],
                                        block_size)
        # Recorded after each step's copies: the host mirrors are not rewritten until the
        # previous copies out of them have finished.
        self._copied = torch.cuda.Event() if pin else None
        self._copied_pending = False

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0
        self.replayed_sizes: set[int] = set()
        self.capture_seconds = 0.0

    def _device_buffers(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions,
                "slot_mapping": self.slot_mapping, "query_start_loc": self.query_start_loc,
                "seq_lens": self.seq_lens, "block_tables": self.block_tables}

    # ---- capture --------------------------------------------------------------------------

    def _meta(self, n: int) -> AttentionMetadata:
        meta = self._metas.get(n)
        if meta is not None:
            return meta
        st = TritonStepTensors(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping[:n],
            # Picks the attention kernel's tuning bucket; a step's own longest query may be
            # shorter, which costs some efficiency, never correctness.
            max_query_len=n, max_seq_len=self.max_model_len, all_decode=False)
        slots = self.seq_lens.shape[0]
        # The host-side lists are never read on this path (the backend finds its tensors in
        # the cache); they only keep the metadata well formed: everything in the dummy slot.
        meta = AttentionMetadata(
            slot_mapping=st.slot_mapping, query_start_loc=[0] + [n] * slots,
            seq_lens=[n] + [0] * (slots - 1), num_computed_tokens=[0] * slots,
            block_tables=self.block_tables, block_size=self.block_size)
        meta.cache[STEP_CACHE_KEY] = st
        self._metas[n] = meta
        return meta

    def _forward(self, n: int) -> None:
        out = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, self._meta(n))
        self.hidden[:n].copy_(out)

    def _stage_padding_only(self, n: int) -> None:
        """Buffers for an all-padding step of n tokens (capture and its warm-up write nothing
        to the KV cache)."""
        self._stager.fill([], n)
        for name, dst in self._device_buffers().items():
            dst.copy_(self._host[name])

    @torch.inference_mode()
    def capture(self) -> None:
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later, smaller graphs reuse the pool memory the larger ones reserved.
        for n in reversed(self.sizes):
            self._stage_padding_only(n)
            # Eager runs first: Triton compiles and autotunes on a new key, which cannot
            # happen inside a capture.
            for _ in range(2):
                self._forward(n)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(n)
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for mixed steps (token counts %s) in %.1f s",
                    len(self.graphs), self.sizes, self.capture_seconds)

    # ---- replay ---------------------------------------------------------------------------

    def can_run(self, scheduled: list[ScheduledRequest]) -> bool:
        return (0 < len(scheduled) <= self.max_reqs
                and sum(s.num_new_tokens for s in scheduled) <= self.max_tokens
                and all(len(s.block_ids) <= self.max_blocks for s in scheduled))

    def run(self, scheduled: list[ScheduledRequest],
            fill_pending: FillPending | None = None) -> tuple[torch.Tensor, list[int]]:
        """Run the step on the static buffers (replaying its graph when captured). Returns the
        final hidden states of the real tokens [T, hidden] (a view of the static output, valid
        until the next run) and the real requests' query_start_loc."""
        T = sum(s.num_new_tokens for s in scheduled)
        n = self.sizes[bisect.bisect_left(self.sizes, T)]
        if self._copied_pending:
            self._copied.synchronize()
        staged = self._stager.fill(scheduled, n)
        rows = len(scheduled) + 1
        non_blocking = self.device.type == "cuda"
        for name, dst in self._device_buffers().items():
            src = self._host[name]
            if name == "block_tables":
                dst, src = dst[:rows], src[:rows]
            elif name in ("input_ids", "positions", "slot_mapping"):
                dst, src = dst[:n], src[:n]
            dst.copy_(src, non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()
            self._copied_pending = True
        if staged.pending_dst:
            assert fill_pending is not None, "a pending input without a way to fill it"
            fill_pending(self.input_ids, staged.pending_dst, staged.pending_req)
        graph = self.graphs.get(n)
        if graph is not None:
            graph.replay()
            self.num_replays += 1
            self.replayed_sizes.add(n)
        else:
            with torch.inference_mode():
                self._forward(n)
        return self.hidden[:T], staged.query_start_loc
