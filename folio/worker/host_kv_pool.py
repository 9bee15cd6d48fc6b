"""The host-memory KV tier's pool on the worker's side (--kv-offloading-size): one host
tensor per layer, [host slots, planes, block_size, heads, width] (a slot's K and V
contiguous), pinned when the cache is on a GPU; and the copies each step's message asks for
(folio/core/kv_offload.py decides them).

The copies run before the step's forward pass, in stream order: first the saves (device
blocks the scheduler evicted, read before this step may overwrite them), then the loads
(host slots into the new device blocks of a prefix hit on the host). One gather or scatter
per layer and direction, batched over the step's blocks.
"""
from __future__ import annotations

import torch


class HostKVPool:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        """Host slots shaped like `kv_caches`' blocks (the worker's cache; it may be
        reallocated, e.g. by sleep mode, so `apply` takes it each time)."""
        if not kv_caches:
            raise ValueError("the host KV tier needs a KV cache")
        self.num_slots = num_slots
        device = kv_caches[0].device
        pin = device.type == "cuda"
        # [planes, blocks, block_size, heads, width] on the device -> a slot's planes together
        self.host = [torch.empty((num_slots, cache.shape[0], *cache.shape[2:]), dtype=cache.dtype,
                                 pin_memory=pin) for cache in kv_caches]

    @staticmethod
    def bytes_per_slot(kv_caches: list[torch.Tensor]) -> int:
        return sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)

    @torch.inference_mode()
    def apply(self, kv_caches: list[torch.Tensor], saves: list[tuple[int, int]],
              loads: list[tuple[int, int]]) -> None:
        """Run a step's copies between `kv_caches` and the pool: saves (device block, host
        slot) first, then loads (host slot, device block)."""
        if saves:
            device = kv_caches[0].device
            blocks = torch.tensor([b for b, _ in saves], dtype=torch.int64, device=device)
            slots = torch.tensor([s for _, s in saves], dtype=torch.int64)
            for cache, host in zip(kv_caches, self.host):
                host[slots] = cache.index_select(1, blocks).transpose(0, 1).to("cpu")
        if loads:
            device = kv_caches[0].device
            slots = torch.tensor([s for s, _ in loads], dtype=torch.int64)
            blocks = torch.tensor([b for _, b in loads], dtype=torch.int64, device=device)
            for cache, host in zip(kv_caches, self.host):
                rows = host.index_select(0, slots).transpose(0, 1)
                cache.index_copy_(1, blocks, rows.to(device, non_blocking=True)
                                  if device.type == "cuda" else rows)
