"""The host-memory KV tier's pool on the worker's side (--kv-offloading-size): one host tensor
[layers, host slots, planes, block_size, heads, width], pinned when the cache is on a GPU, and
the copies each step's message asks for (folio/core/kv_offload.py decides them).

Saves (device blocks the scheduler evicted) run before the step's forward pass, in stream
order, so they read the blocks before this step may overwrite them. Loads (host slots into
the new device blocks of a prefix hit on the host tier) are where the tier's time goes: on
the H200 a 1,600-token Llama-3-8B prefix (200 MB) loaded in stream order before the forward
took the step from 9.4 ms (a device hit) to 18.0 ms. So on a GPU the loads run on a side
stream, layer by layer, each layer's copies ending in an event (`LayerLoads`), and the
forward pass waits for a layer's event only when it reaches that layer: the PCIe copies of
layer j + 1 overlap the compute of layer j.

A step that loads usually saves too: the device blocks a host-tier hit loads into are the
cached blocks the pool just evicted, and those are saved first (in the bench's case, 200 MB
each way in one step). In stream order the saves' device-to-host copies and the loads'
host-to-device ones ran one after the other, and the forward after both. `transfer` runs
them as a pipeline instead: the saves on a second side stream, layer by layer, each layer's
loads waiting only for that layer's saves, so the two directions of the PCIe link (separate
copy engines) work at once and the forward starts at once. A step that saves and does not
load keeps its saves in stream order (no waits to make; its decode graph replays).

Why layer-major: a layer's blocks for a run of consecutive host slots are then one contiguous
host range, one DMA; the first layout (a host tensor per layer, gathered on the CPU into
pageable memory) took 122 ms for the same load, slower than recomputing (46 ms). Each DMA
lands in a device staging buffer, and the layer's blocks are scattered from it on the device.
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
        self.slots = torch.empty((len(kv_caches), num_slots, *block_shape), dtype=first.dtype,
                                 pin_memory=self._cuda)
        # Per-layer views, [slots, planes, block_size, heads, width] (the disk tier's files
        # hold a slot of each, in layer order).
        self.host = [self.slots[i] for i in range(len(kv_caches))]
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
        block), as `save` then `load` would leave them; on a GPU, with both, pipelined layer
        by layer on the two side streams (the module's docstring says why). Returns what
        `load` returns: the forward waits for each layer's LayerLoads event, which comes
        after that layer's saves as well."""
        if not (self._cuda and saves and loads):
            self.save(kv_caches, saves)
            return self.load(kv_caches, loads)
        main = torch.cuda.current_stream(kv_caches[0].device)
        self._save_stream.wait_stream(main)
        saved = []
        with torch.cuda.stream(self._save_stream):
            self._save_layers(kv_caches, saves, after_each=saved)
        return self.load(kv_caches, loads, after_saves=saved)

    @torch.inference_mode()
    def save(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots, pairs (device block, host slot), in the
        current stream's order."""
        self._save_layers(kv_caches, saves)

    @torch.inference_mode()
    def _save_layers(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
                     after_each: list | None = None) -> None:
        """The saves on the current stream; `after_each`, when given, gets an event recorded
        after each layer's copies. On a side stream the temporaries are allocated and used
        there only, so the caching allocator hands their memory on after these copies."""
        if not saves:
            return
        pairs = sorted((slot, block) for block, slot in saves)
        runs = _runs(pairs)
        blocks = _device_index([b for _, b in pairs], kv_caches[0].device)
        for layer, cache in enumerate(kv_caches):
            staged = cache.index_select(1, blocks).transpose(0, 1).contiguous()  # [n, planes, ...]
            for start, slot, length in runs:
                self.slots[layer, slot:slot + length].copy_(staged[start:start + length],
                                                            non_blocking=self._cuda)
            if after_each is not None:
                event = torch.cuda.Event()
                event.record()
                after_each.append(event)
        self._pending = self._cuda

    @torch.inference_mode()
    def load(self, kv_caches: list[torch.Tensor], loads: list[tuple[int, int]],
             after_saves: list | None = None) -> LayerLoads | None:
        """Copy host slots into device blocks, pairs (host slot, device block), after
        everything queued so far (this step's saves may have read the blocks the loads
        overwrite) and, given `after_saves` (one event per layer, `transfer`), each layer's
        after that layer's event. On a CPU the copies are done on return (None); on a GPU
        they run on the side stream, and the returned LayerLoads says when each layer's are
        done."""
        if not loads:
            return None
        pairs = sorted(loads)
        runs = _runs(pairs)
        device = kv_caches[0].device
        if not self._cuda:
            blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
            for layer, cache in enumerate(kv_caches):
                cache.index_copy_(1, blocks, self.slots[layer].index_select(0, slots)
                                  .transpose(0, 1))
            return None
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(device))
        events = []
        with torch.cuda.stream(side):
            # Allocated on the side stream and used only there: the caching allocator hands
            # their memory to other work of this stream only, after these copies.
            blocks = _device_index([b for _, b in pairs], device)
            staged = torch.empty((len(pairs), *self.slots.shape[2:]), dtype=self.slots.dtype,
                                 device=device)
            for layer, cache in enumerate(kv_caches):
                if after_saves is not None:
                    side.wait_event(after_saves[layer])
                for start, slot, length in runs:
                    staged[start:start + length].copy_(self.slots[layer, slot:slot + length],
                                                       non_blocking=True)
                cache.index_copy_(1, blocks, staged.transpose(0, 1))
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)
        self._pending = True
        return LayerLoads(events)
