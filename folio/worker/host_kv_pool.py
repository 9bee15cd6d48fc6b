"""The host-memory KV tier's pool on the worker's side (--kv-offloading-size): one host tensor
[host slots, layers, planes, block_size, heads, width], pinned when the cache is on a GPU, so
that a slot holds a block's K and V of every layer in one contiguous run; and the copies each
step's message asks for (folio/core/kv_offload.py decides them).

The copies run before the step's forward pass, in stream order: first the saves (device
blocks the scheduler evicted, read before this step may overwrite them), then the loads
(host slots into the new device blocks of a prefix hit on the host).

Why block-major: on the H200 the first layout (a host tensor per layer, gathered on the CPU
into pageable memory, then copied) took 122 ms to load a 1,600-token Llama-3-8B prefix (200
MB) — slower than recomputing it (46 ms). Now a load copies runs of consecutive slots from
pinned memory to a device staging buffer, one DMA per run, and scatters each layer's blocks
on the device; a save gathers on the device and copies runs back the same way. Both are
asynchronous on a GPU: host memory is read by the CPU (the disk tier's files) only after
`sync()`.
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


class HostKVPool:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        """Host slots shaped like `kv_caches`' blocks (the worker's cache; it may be
        reallocated, e.g. by sleep mode, so `apply` takes it each time)."""
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
        # Per-layer views, [slots, planes, block_size, heads, width]: a slot's layer is
        # contiguous (the disk tier's files are these, in layer order).
        self.host = [self.slots[:, i] for i in range(len(kv_caches))]
        self._pending = False      # asynchronous copies into host memory not yet waited for

    @staticmethod
    def bytes_per_slot(kv_caches: list[torch.Tensor]) -> int:
        return sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)

    def sync(self) -> None:
        """Wait for the saves in flight, before the CPU reads or writes host slots."""
        if self._pending:
            torch.cuda.current_stream().synchronize()
            self._pending = False

    @torch.inference_mode()
    def apply(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
              loads: list[tuple[int, int]]) -> None:
        """Run a step's copies between `kv_caches` and the pool: saves (device block, host
        slot) first, then loads (host slot, device block)."""
        device = kv_caches[0].device
        if saves:
            pairs = sorted((slot, block) for block, slot in saves)
            blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=device)
            staged = torch.empty((len(pairs), *self.slots.shape[1:]), dtype=self.slots.dtype,
                                 device=device)
            for layer, cache in enumerate(kv_caches):
                staged[:, layer].copy_(cache.index_select(1, blocks).transpose(0, 1))
            for start, slot, length in _runs(pairs):
                self.slots[slot:slot + length].copy_(staged[start:start + length],
                                                     non_blocking=self._cuda)
            self._pending = self._cuda
        if loads:
            pairs = sorted(loads)
            blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=device)
            staged = torch.empty((len(pairs), *self.slots.shape[1:]), dtype=self.slots.dtype,
                                 device=device)
            for start, slot, length in _runs(pairs):
                staged[start:start + length].copy_(self.slots[slot:slot + length],
                                                   non_blocking=self._cuda)
            for layer, cache in enumerate(kv_caches):
                cache.index_copy_(1, blocks, staged[:, layer].transpose(0, 1))
