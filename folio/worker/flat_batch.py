"""The flat batch of one step: every scheduled token in one row, requests back to back. One
builder for every way a step runs — eager, decode CUDA graphs, mixed CUDA graphs — differing
only in how the batch is padded to a captured size:

  * `Padding.NONE` (eager): exactly the step's tokens.
  * `Padding.DECODE_ROWS` (decode graphs, one token per request): rows past the batch write
    nothing to the KV cache (slot -1) and attend over one key of block 0 (seq_len 1).
  * `Padding.DUMMY_REQUEST` (mixed graphs): tokens [T, n) belong to one extra request slot B,
    a fresh prefill of n - T tokens over whatever valid block ids its row holds; slots past it
    have no tokens.

Padding rows never touch a real row: every op but attention is row-wise, and attention reads
only its own request's context (the cache holds finite values only, so padding stays finite).
The builder writes numpy views of host buffers (pinned on CUDA); the caller copies them to the
device and must not let the next step rewrite them before those copies are done
(`StepBuffers.wait_for_copies`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from folio.core.step_messages import SchedulerOutput
from folio.worker.input_batch import InputBatch


_PLACEHOLDER = np.zeros(1, dtype=np.int32)


class Padding(enum.Enum):
    NONE = enum.auto()
    DECODE_ROWS = enum.auto()
    DUMMY_REQUEST = enum.auto()


# Sections of StepBuffers' arena start on this many bytes (each dtype's alignment and more).
_ALIGN = 64


@dataclass
class StepMirror:
    """Device tensors laid out in one device arena as a StepBuffers' host arena is, so that
    `StepBuffers.copy_to` moves a step's inputs in one copy (the CUDA-graph runners' static
    input buffers)."""
    arena: torch.Tensor
    tensors: dict[str, torch.Tensor]
    # (device, host) views of the arenas' first `end` bytes, made once per `end`: slicing
    # both arenas cost the host ~3.6 of a copy's 7 µs (the lent H100, tools/gpu_host_costs.py),
    # all of it in a verify step's exposed turn-around.
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class StepBuffers:
    """Host buffers for steps of up to `max_tokens` tokens and `max_reqs` request slots, as
    torch tensors (pinned on CUDA, for asynchronous copies) and numpy views of them. Slot
    mapping and block tables exist once per KV cache group (`slot_mapping`, `block_tables`:
    group 0's; `slot_mapping.g`, `block_tables.g`: group g's).

    All of them are views of one byte arena, the per-token and per-request arrays first and
    the block tables last, so a graph runner's step goes to the device in one copy (each
    further copy cost the host ~5-8 µs in the verify step's exposed turn-around)."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, pin: bool,
                 num_kv_groups: int = 1) -> None:
        groups = range(1, num_kv_groups)
        specs = [("input_ids", (max_tokens,), torch.int64, 0),
                 ("positions", (max_tokens,), torch.int64, 0),
                 ("slot_mapping", (max_tokens,), torch.int64, -1),
                 *((f"slot_mapping.{g}", (max_tokens,), torch.int64, -1) for g in groups),
                 ("query_start_loc", (max_reqs + 1,), torch.int32, 0),
                 ("seq_lens", (max_reqs,), torch.int32, 0),
                 ("block_tables", (max_reqs, max_blocks), torch.int32, 0),
                 *((f"block_tables.{g}", (max_reqs, max_blocks), torch.int32, 0)
                   for g in groups)]
        self._layout: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {}
        size = 0
        for name, shape, dtype, fill in specs:
            self._layout[name] = (size, shape, dtype, fill)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            size += -(-nbytes // _ALIGN) * _ALIGN
        self._arena = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.tensors = self._views(self._arena)
        self._block_row_bytes = max_blocks * torch.int32.itemsize
        self._num_kv_groups = num_kv_groups
        arrays = {name: t.numpy() for name, t in self.tensors.items()}
        self.ids = arrays["input_ids"]
        self.pos = arrays["positions"]
        self.slots = arrays["slot_mapping"]
        self.qsl = arrays["query_start_loc"]
        self.seq = arrays["seq_lens"]
        self.bt = arrays["block_tables"]
        self.group_slots = [self.slots] + [arrays[f"slot_mapping.{g}"] for g in groups]
        self.group_bt = [self.bt] + [arrays[f"block_tables.{g}"] for g in groups]
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        # Recorded after the copies out of these buffers (CUDA): the next step waits for it
        # before writing them again.
        self._copied = torch.cuda.Event() if pin else None
        self._copied_pending = False
        # The stream the copies are queued on, kept from the first: `Event.record()` looks the
        # current stream up each time (~4 µs of host, against ~1 µs given the stream). The
        # runners queue every step's copies on the worker's one compute stream.
        self._stream: torch.cuda.Stream | None = None

    def _views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each array as a view of `arena` (this layout), filled with its initial value."""
        views = {}
        for name, (offset, shape, dtype, fill) in self._layout.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            views[name] = arena[offset:offset + nbytes].view(dtype).view(shape).fill_(fill)
        return views

    def mirror(self, device: torch.device) -> StepMirror:
        """Device arrays laid out as these (initially as filled here), for `copy_to`."""
        arena = torch.empty(self._arena.numel(), dtype=torch.uint8, device=device)
        return StepMirror(arena, self._views(arena))

    def copy_to(self, mirror: StepMirror, block_rows: int) -> None:
        """One asynchronous copy into `mirror`: every per-token and per-request array whole,
        and the first `block_rows` block-table rows (one KV cache group: the padded steps'
        case). The caller calls copies_queued() after."""
        assert self._num_kv_groups == 1, "one copy covers one KV cache group's block tables"
        end = self._layout["block_tables"][0] + block_rows * self._block_row_bytes
        views = mirror.views.get(end)
        if views is None:
            assert mirror.arena.numel() == self._arena.numel(), "a mirror of other buffers"
            views = mirror.views[end] = (mirror.arena[:end], self._arena[:end])
        views[0].copy_(views[1], non_blocking=mirror.arena.is_cuda)

    def wait_for_copies(self) -> None:
        if self._copied_pending:
            self._copied.synchronize()
            self._copied_pending = False

    def copies_queued(self) -> None:
        if self._copied is not None:
            if self._stream is None:
                self._stream = torch.cuda.current_stream()
            self._copied.record(self._stream)
            self._copied_pending = True


@dataclass
class FlatBatch:
    """What a built step looks like (the values live in the StepBuffers)."""
    num_tokens: int                # T, the step's real tokens
    num_reqs: int                  # B
    padded_tokens: int             # n >= T: the rows to run (T when unpadded)
    query_start_loc: list[int]     # B + 1 entries, the real requests only
    seq_lens: list[int]
    num_computed_tokens: list[int]
    width: int                     # block-table columns the real requests use (group 0)
    # Flat positions whose input id is still being sampled by the step before (async
    # scheduling), and those requests' rows in that step's sampled ids.
    pending_dst: list[int]
    pending_src: list[int]
    # Block-table columns of each KV cache group.
    widths: list[int]


def build_flat_batch(step: SchedulerOutput, batch: InputBatch | None, prev_rows: dict[str, int],
                     buf: StepBuffers, block_size: int, padding: Padding = Padding.NONE,
                     padded: int | None = None) -> FlatBatch:
    """Write the step's inputs into `buf`, padded to `padded` tokens (DECODE_ROWS: rows) as
    `padding` says. `prev_rows`: each request's row in the previous step's sampled ids.
    `batch` may be None for a step with no requests (padding only)."""
    order = step.num_scheduled_tokens
    B = len(order)
    states = [batch.requests[rid] for rid in order] if B else []
    if 0 < B <= SMALL_BATCH and len(buf.group_bt) == 1 \
            and not any(s.position_offset for s in states):
        return _build_small(step, batch, states, prev_rows, buf, block_size, padding, padded)
    counts = np.fromiter(order.values(), np.int64, B)
    starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, B)
    rows = np.fromiter((s.row for s in states), np.int64, B)
    qsl = np.zeros(B + 1, np.int64)
    np.cumsum(counts, out=qsl[1:])
    T = int(qsl[-1])
    n = T if padded is None else padded
    assert T <= n <= buf.max_tokens and B + 1 <= buf.max_reqs + 1, "step exceeds its buffers"

    # Input ids: the known tokens, and a placeholder where the last input is still on the
    # device (filled there by the runner).
    ids, pos, slots, bt = buf.ids, buf.pos, buf.slots, buf.bt
    pending_dst: list[int] = []
    pending_src: list[int] = []
    if B:
        known = batch.num_tokens[rows]
        if T == B:
            # Pure decode, the common step: one gather from the token rows.
            ids[:B] = batch.token_ids[rows, np.minimum(starts, batch.max_model_len - 1)]
            missing = np.flatnonzero(starts >= known)
            if len(missing):
                ids[missing] = 0
                req_ids = list(order)
                pending_dst = missing.tolist()
                pending_src = [prev_rows[req_ids[j]] for j in pending_dst]
        else:
            pieces = []
            spec = step.scheduled_spec_decode_tokens
            for j, (rid, row, start, num, n_known) in enumerate(zip(
                    order, rows.tolist(), starts.tolist(), counts.tolist(), known.tolist())):
                end = start + num
                drafts = spec.get(rid) if spec else None
                if drafts:
                    # A verify step: the last token, then the draft tokens after it.
                    assert end == n_known + len(drafts), "drafts follow a request's last token"
                    pieces.append(batch.token_ids[row, start:n_known])
                    pieces.append(np.asarray(drafts, dtype=np.int32))
                    continue
                if end <= n_known:
                    pieces.append(batch.token_ids[row, start:end])
                    continue
                assert end == n_known + 1, "only the last input of a request can be pending"
                pieces.append(batch.token_ids[row, start:n_known])
                pending_dst.append(int(qsl[j + 1]) - 1)
                pending_src.append(prev_rows[rid])
                pieces.append(_PLACEHOLDER)
            ids[:T] = np.concatenate(pieces)

    req_of = np.repeat(np.arange(B), counts)
    positions = starts[req_of] + (np.arange(T) - qsl[:-1][req_of])
    pos[:T] = positions
    if B and any(s.position_offset for s in states):
        # M-RoPE requests past their prompt: rotary positions run `position_offset` from
        # the token index (KV slots still follow the index)
        offsets = np.fromiter((s.position_offset for s in states), np.int64, B)
        pos[:T] += offsets[req_of]
    widths = []
    for g, (g_bt, g_slots) in enumerate(zip(buf.group_bt, buf.group_slots)):
        width = int(batch.group_num_blocks[g][rows].max()) if B else 0
        if width:
            g_bt[:B, :width] = batch.block_tables[g][rows, :width]
        g_slots[:T] = g_bt[req_of, positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        widths.append(width)
    assert padding is Padding.NONE or len(widths) == 1, "padded steps have one KV cache group"
    seq = starts + counts
    buf.qsl[:B + 1] = qsl
    buf.seq[:B] = seq
    _pad(buf, padding, B, T, n)
    return FlatBatch(T, B, n, qsl.tolist(), seq.tolist(), starts.tolist(), widths[0],
                     pending_dst, pending_src, widths)


def _pad(buf: StepBuffers, padding: Padding, B: int, T: int, n: int) -> None:
    """The padding rows [T, n) (DECODE_ROWS: rows [B, n)) as `padding` says."""
    if padding is Padding.DECODE_ROWS:
        buf.ids[B:n] = 0
        buf.pos[B:n] = 0
        buf.slots[B:n] = -1
        buf.qsl[B + 1:n + 1] = np.arange(B + 1, n + 1)   # padding row i is query i
        buf.seq[B:n] = 1
        buf.bt[B:n, 0] = 0
    elif padding is Padding.DUMMY_REQUEST:
        buf.ids[T:n] = 0
        buf.pos[T:n] = 0
        buf.slots[T:n] = -1
        buf.qsl[B + 1:] = n          # slot B (the dummy) owns [T, n); later slots are empty
        buf.seq[B] = n - T
        buf.seq[B + 1:] = 0


# Steps of at most this many requests are built request by request in plain Python: a batch-1
# verify step's build was ~100 µs of numpy calls on the lent H100's host, all of it exposed
# (the device waits for the step; docs/benchmarks.md session 27), where a few slice writes per
# request do. Larger batches amortize numpy's per-call cost over their rows.
SMALL_BATCH = 4


def _build_small(step: SchedulerOutput, batch: InputBatch, states: list,
                 prev_rows: dict[str, int], buf: StepBuffers, block_size: int,
                 padding: Padding, padded: int | None) -> FlatBatch:
    """build_flat_batch for 1..SMALL_BATCH requests, one KV cache group and no M-RoPE
    position offsets: the same buffer contents and FlatBatch, request by request."""
    order = step.num_scheduled_tokens
    spec = step.scheduled_spec_decode_tokens
    token_ids, num_tokens = batch.token_ids, batch.num_tokens
    src_bt, src_blocks = batch.block_tables[0], batch.group_num_blocks[0]
    ids, pos, slots, bt = buf.ids, buf.pos, buf.slots, buf.bt
    B = len(states)
    width = max(int(src_blocks[s.row]) for s in states)
    qsl, seq, starts = [0], [], []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    for j, (rid, state) in enumerate(zip(order, states)):
        row, start, num = state.row, state.num_computed_tokens, order[rid]
        a, end = qsl[-1], start + num
        known = int(num_tokens[row])
        drafts = spec.get(rid) if spec else None
        if drafts:
            # A verify step: the last token, then the draft tokens after it.
            assert end == known + len(drafts), "drafts follow a request's last token"
            ids[a:a + known - start] = token_ids[row, start:known]
            ids[a + known - start:a + num] = drafts
        elif end <= known:
            ids[a:a + num] = token_ids[row, start:end]
        elif num == 1 and start >= known:
            # a decode input still on the device: a placeholder, filled there by the runner
            ids[a] = 0
            pending_dst.append(a)
            pending_src.append(prev_rows[rid])
        else:
            assert end == known + 1, "only the last input of a request can be pending"
            ids[a:a + num - 1] = token_ids[row, start:known]
            ids[a + num - 1] = 0
            pending_dst.append(a + num - 1)
            pending_src.append(prev_rows[rid])
        positions = np.arange(start, end)
        pos[a:a + num] = positions
        if width:
            bt[j, :width] = src_bt[row, :width]
        slots[a:a + num] = bt[j, positions // block_size].astype(np.int64) * block_size \
            + positions % block_size
        qsl.append(a + num)
        seq.append(end)
        starts.append(start)
    T = qsl[-1]
    n = T if padded is None else padded
    assert T <= n <= buf.max_tokens and B + 1 <= buf.max_reqs + 1, "step exceeds its buffers"
    buf.qsl[:B + 1] = qsl
    buf.seq[:B] = seq
    _pad(buf, padding, B, T, n)
    return FlatBatch(T, B, n, qsl, seq, starts, width, pending_dst, pending_src, [width])

