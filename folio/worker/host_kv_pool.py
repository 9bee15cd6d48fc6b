"""The host-memory KV tier's pool on the worker's side (--kv-offloading-size): one host tensor
[host slots, layers, planes, block_size, heads, width], pinned when the cache is on a GPU, and
the copies each step's message asks for (folio/core/kv_offload.py decides them).

Saves (device blocks the scheduler evicted) are gathered on the device in stream order, so
they read the blocks before this step may overwrite them; their device-to-host copies then run
on a save stream. Loads (host slots into the new device blocks of a prefix hit on the host
tier) are where the tier's time goes: on a GPU their host-to-device copies are queued first
on a load stream, the saves' copies wait for them (the two directions at once share the bus),
and the forward pass waits for one event after the loads' scatters, so the step still runs
as a CUDA graph. (Per-layer events, with the forward waiting for each layer's blocks as it
reached the layer, forced the step to run eagerly; on an H100 the eager 16-token step of a
Llama-3-8B shape took ~22 ms of launches where its graph takes ~9 ms, while the layout below
left nothing to overlap: every layer's blocks arrive in the one copy per run of slots.)

Why slot-major: a slot's blocks of every layer are one contiguous host range, so a load makes
one DMA per run of consecutive slots. The earlier layout was layer-major ([layers, slots,
...]), a DMA per run per layer; once the tier had filled and its LRU victims left a prefix's
slots scattered, that was a DMA per block and layer — 3,200 copies of 64 KiB for a
1,600-token Llama-3-8B prefix, 35 ms on the H200 for 200 MB, bound by launching them
(consecutive slots: 4.8 ms). Slot-major, the same load is 100 copies of 2 MiB whatever the
slots (4.6 ms on an H100, scattered or not). The device staging buffers are taken in chunks
of slots (`_CHUNK_BYTES`), not a whole prefix at once.
Host memory is read or written by the CPU (the disk tier's files) only after `sync()`.
"""
from __future__ import annotations

import torch

from folio.model.host_copy import device_tensor


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start in `pairs`, first slot, length) of each run of consecutive slots, for pairs
    (slot, other) sorted by slot."""
    runs = []
    start = 0
    for i in range(1, len(pairs) + 1):
        if i == len(pairs) or pairs[i][0] != pairs[i - 1][0] + 1:
            runs.append((start, pairs[start][0], i - start))
            start = i
    return runs


# Device staging of a step's copies: at most this many bytes of slots at a time (a long
# prefix of a large model would otherwise stage gigabytes beside the KV cache).
_CHUNK_BYTES = 256 << 20


def _chunks(runs: list[tuple[int, int, int]], max_slots: int
            ) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """`runs` (start in the pairs, first slot, length) cut into chunks of at most `max_slots`
    slots: (the chunk's first pair, its runs with starts relative to that pair). Runs cover
    the pairs in order, so a chunk is the pairs [first, first + its slots)."""
    chunks, current, room, base = [], [], max_slots, 0
    for start, slot, length in runs:
        while length > 0:
            take = min(length, room)
            if not current:
                base = start
            current.append((start - base, slot, take))
            start, slot, length, room = start + take, slot + take, length - take, room - take
            if room == 0:
                chunks.append((base, current))
                current, room = [], max_slots
    if current:
        chunks.append((base, current))
    return chunks


class HostKVPool:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        """Host slots shaped like `kv_caches`' blocks (the worker's cache; it may be
        reallocated, e.g. by sleep mode, so the copies take it each time)."""
        if not kv_caches:
            raise ValueError("the host KV tier needs a KV cache")
        first = kv_caches[0]
        block_shape = (first.shape[0], *first.shape[2:])      # planes, block_size, heads, width
        if any(c.dtype != first.dtype or (c.shape[0], *c.shape[2:]) != block_shape
               for c in kv_caches):
            raise ValueError("the host KV tier needs every layer's blocks of one shape and dtype")
        self.num_slots = num_slots
        self._cuda = first.device.type == "cuda"
        self.slots = torch.empty((num_slots, len(kv_caches), *block_shape), dtype=first.dtype,
                                 pin_memory=self._cuda)
        # Per-layer views, [slots, planes, block_size, heads, width] (the disk tier's files
        # hold a slot of each, in layer order: the slot's own contiguous range).
        self.host = [self.slots[:, i] for i in range(len(kv_caches))]
        slot_bytes = self.slots[0].numel() * self.slots.element_size()
        self._chunk_slots = max(1, _CHUNK_BYTES // max(slot_bytes, 1))
        self._pending = False      # asynchronous copies from or into host memory not waited for
        self._stream = torch.cuda.Stream(first.device) if self._cuda else None        # loads
        self._save_stream = torch.cuda.Stream(first.device) if self._cuda else None   # saves
        # recorded on the save stream after the latest saves' copies: a later load of those
        # slots reads them after it
        self._saves_done: torch.cuda.Event | None = None

    @staticmethod
    def bytes_per_slot(kv_caches: list[torch.Tensor]) -> int:
        return sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)

    def sync(self) -> None:
        """Wait for the copies in flight, before the CPU reads or writes host slots."""
        if self._pending:
            torch.cuda.current_stream().synchronize()
            self._save_stream.synchronize()
            self._stream.synchronize()
            self._pending = False

    def transfer(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
                 loads: list[tuple[int, int]]) -> torch.cuda.Event | None:
        """A step's saves (device block, host slot) and loads (host slot, device block), as
        the saves then the loads in order would leave them: a load may land in a block a save
        of the same step reads. On a CPU the copies are done on return (None). On a GPU they
        are still in flight, and the returned event (None without loads) is recorded once
        every load is in place: the forward pass waits for it.

        The GPU order: the loads' host-to-device copies first (side stream: they read host
        slots no save of this step writes — a slot serves one block a step — after the
        earlier steps' saves into them are done); the saves' gathers on the current stream
        (in stream order, before this step overwrites their blocks); their device-to-host
        copies on the save stream once the loads' copies are done, so that the two do not
        share the bus (measured on an H100: 200 MB each way at once took 6.0 ms, one way
        3.8 ms); then the loads' scatters into the cache after the gathers."""
        if not self._cuda:
            self._save(kv_caches, saves)
            if loads:
                pairs = sorted(loads)
                blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64)
                for first, chunk in _chunks(_runs(pairs), self._chunk_slots):
                    self._scatter(kv_caches, first, chunk, blocks,
                                  self._stage(kv_caches, chunk))
            return None
        device = kv_caches[0].device
        side = self._stream
        staged = None
        if loads:
            pairs = sorted(loads)
            chunks = _chunks(_runs(pairs), self._chunk_slots)
            if self._saves_done is not None:
                side.wait_event(self._saves_done)
            with torch.cuda.stream(side):
                # Allocated on the side stream and used only there: the caching allocator
                # hands their memory to other work of this stream only, after these copies.
                blocks = device_tensor([b for _, b in pairs], device, torch.int64)
                staged = self._stage(kv_caches, chunks[0][1])
            copied = side.record_event()
        if saves:
            self._save(kv_caches, saves, after=copied if loads else None)
        if not loads:
            return None
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i, (first, chunk) in enumerate(chunks):
                if i > 0:
                    staged = self._stage(kv_caches, chunk)
                self._scatter(kv_caches, first, chunk, blocks, staged)
        self._pending = True
        return side.record_event()

    def save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots, pairs (device block, host slot) (`transfer`)."""
        self.transfer(kv_caches, saves, [])

    def load(self, kv_caches: list[torch.Tensor], loads: list[tuple[int, int]]
             ) -> torch.cuda.Event | None:
        """Copy host slots into device blocks, pairs (host slot, device block) (`transfer`)."""
        return self.transfer(kv_caches, [], loads)

    @torch.inference_mode()
    def _save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
              after: torch.cuda.Event | None = None) -> None:
        """The saves: gathered from the caches in the current stream's order, copied to the
        host on the save stream (after `after`, where given)."""
        if not saves:
            return
        pairs = sorted((slot, block) for block, slot in saves)
        device = kv_caches[0].device
        blocks = device_tensor([b for _, b in pairs], device, torch.int64)
        for first, chunk in _chunks(_runs(pairs), self._chunk_slots):
            count = sum(length for _, _, length in chunk)
            index = blocks[first:first + count]
            # [count, layers, planes, ...]: each slot's blocks of every layer, contiguous
            staged = torch.stack([cache.index_select(1, index).transpose(0, 1)
                                  for cache in kv_caches], dim=1)
            if not self._cuda:
                for start, slot, length in chunk:
                    self.slots[slot:slot + length].copy_(staged[start:start + length])
                continue
            self._save_stream.wait_stream(torch.cuda.current_stream(device))
            if after is not None:
                self._save_stream.wait_event(after)
            with torch.cuda.stream(self._save_stream):
                for start, slot, length in chunk:
                    self.slots[slot:slot + length].copy_(staged[start:start + length],
                                                         non_blocking=True)
            staged.record_stream(self._save_stream)   # kept until those copies are done
        if self._cuda:
            self._saves_done = self._save_stream.record_event()
            self._pending = True

    @torch.inference_mode()
    def _stage(self, kv_caches: list[torch.Tensor], chunk: list[tuple[int, int, int]]
               ) -> torch.Tensor:
        """A chunk's host slots copied to a device staging buffer, one copy per run of
        consecutive slots."""
        count = sum(length for _, _, length in chunk)
        staged = torch.empty((count, *self.slots.shape[1:]), dtype=self.slots.dtype,
                             device=kv_caches[0].device)
        for start, slot, length in chunk:
            staged[start:start + length].copy_(self.slots[slot:slot + length],
                                               non_blocking=self._cuda)
        return staged

    @torch.inference_mode()
    def _scatter(self, kv_caches: list[torch.Tensor], first: int,
                 chunk: list[tuple[int, int, int]], blocks: torch.Tensor,
                 staged: torch.Tensor) -> None:
        """A staged chunk (pairs [first, first + its slots); `blocks` every pair's device
        block) scattered into each layer's cache."""
        index = blocks[first:first + staged.shape[0]]
        for layer, cache in enumerate(kv_caches):
            cache.index_copy_(1, index, staged[:, layer].transpose(0, 1))
