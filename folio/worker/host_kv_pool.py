"""The host-memory KV tier's pool on the worker's side (--kv-offloading-size): one host tensor
[host slots, layers, planes, block_size, heads, width], pinned when the cache is on a GPU, and
the copies each step's message asks for (folio/core/kv_offload.py decides them).

Saves (device blocks the scheduler evicted) are gathered on the device in stream order, so
they read the blocks before this step may overwrite them; their device-to-host copies then run
on a side stream. Loads (host slots into the new device blocks of a prefix hit on the host
tier) are where the tier's time goes, and on a GPU they too run on a side stream: each layer's
blocks scattered into the cache end in an event (`LayerLoads`), and the forward pass waits for
a layer's event only when it reaches that layer.

Why slot-major: a slot's blocks of every layer are one contiguous host range, so a load makes
one DMA per run of consecutive slots. The earlier layout was layer-major ([layers, slots,
...]), a DMA per run per layer, so that the copies of layer j + 1 could overlap the compute of
layer j; but once the tier had filled and its LRU victims left a prefix's slots scattered,
that was a DMA per block and layer — 3,200 copies of 64 KiB for a 1,600-token Llama-3-8B
prefix, 35 ms on the H200 for 200 MB, bound by launching them (consecutive slots: 4.8 ms).
Slot-major, the same load is 100 copies of 2 MiB whatever the slots (4.1 ms measured for such
copies), and the per-layer overlap it gives up was worth ~1.6 ms there. The device staging
buffers are taken in chunks of slots (`_CHUNK_BYTES`), not a whole prefix at once.
Host memory is read or written by the CPU (the disk tier's files) only after `sync()`.
"""
from __future__ import annotations

import torch


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


def _device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on `device`, copied without making the host wait: from pageable
    memory a host-to-device copy first waits for the stream (behind this step's saves and
    the previous step's work, under async scheduling); from pinned memory it is queued. The
    caching host allocator keeps the pinned buffer until the copy is done."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class LayerLoads:
    """A step's host-tier loads in flight on a side stream: `wait(j)` makes the current
    stream wait until the j-th layer's blocks (of the caches the loads were given) are in
    place. Waiting twice for a layer costs nothing more."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[layer])

    def wait_all(self) -> None:
        self.wait(len(self.events) - 1)    # the side stream records the layers in order


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
                 loads: list[tuple[int, int]]) -> LayerLoads | None:
        """A step's saves (device block, host slot), then its loads (host slot, device
        block), as `save` then `load` would leave them: the saves' gathers are queued on the
        current stream first, so the loads (after them) may overwrite the blocks they read
        while the saves' copies to the host still run. Returns what `load` returns."""
        self.save(kv_caches, saves)
        return self.load(kv_caches, loads)

    @torch.inference_mode()
    def save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots, pairs (device block, host slot): gathered from
        the caches in the current stream's order, copied to the host on the save stream."""
        if not saves:
            return
        pairs = sorted((slot, block) for block, slot in saves)
        device = kv_caches[0].device
        blocks = _device_index([b for _, b in pairs], device)
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
            with torch.cuda.stream(self._save_stream):
                for start, slot, length in chunk:
                    self.slots[slot:slot + length].copy_(staged[start:start + length],
                                                         non_blocking=True)
            staged.record_stream(self._save_stream)   # kept until those copies are done
        self._pending = self._cuda

    @torch.inference_mode()
    def load(self, kv_caches: list[torch.Tensor], loads: list[tuple[int, int]]
             ) -> LayerLoads | None:
        """Copy host slots into device blocks, pairs (host slot, device block), after
        everything queued so far on the current stream (this step's saves gathered the blocks
        the loads overwrite). On a CPU the copies are done on return (None); on a GPU they
        run on the side stream, and the returned LayerLoads says when each layer's are
        done."""
        if not loads:
            return None
        pairs = sorted(loads)
        device = kv_caches[0].device
        chunks = _chunks(_runs(pairs), self._chunk_slots)
        if not self._cuda:
            blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            for first, chunk in chunks:
                self._load_chunk(kv_caches, first, chunk, blocks)
            return None
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(device))
        events = []
        with torch.cuda.stream(side):
            # Allocated on the side stream and used only there: the caching allocator hands
            # their memory to other work of this stream only, after these copies.
            blocks = _device_index([b for _, b in pairs], device)
            for i, (first, chunk) in enumerate(chunks):
                last = i == len(chunks) - 1
                self._load_chunk(kv_caches, first, chunk, blocks, events if last else None)
        self._pending = True
        return LayerLoads(events)

    def _load_chunk(self, kv_caches: list[torch.Tensor], first: int,
                    chunk: list[tuple[int, int, int]], blocks: torch.Tensor,
                    events: list | None = None) -> None:
        """One chunk of runs (pairs [first, first + its slots), `blocks` every pair's device
        block): its slots to a device staging buffer, one copy per run, then scattered into
        each layer's cache; `events` gets one per layer after its scatter."""
        count = sum(length for _, _, length in chunk)
        staged = torch.empty((count, *self.slots.shape[1:]), dtype=self.slots.dtype,
                             device=kv_caches[0].device)
        for start, slot, length in chunk:
            staged[start:start + length].copy_(self.slots[slot:slot + length],
                                               non_blocking=self._cuda)
        index = blocks[first:first + count]
        for layer, cache in enumerate(kv_caches):
            cache.index_copy_(1, index, staged[:, layer].transpose(0, 1))
            if events is not None:
                event = torch.cuda.Event()
                event.record()
                events.append(event)
