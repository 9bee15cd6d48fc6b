"""Pins: references on a finished request's cached KV blocks, kept for a time-to-live.

A freed block stays in the prefix cache only until the LRU eviction hands it out again, so
under other traffic a conversation's blocks are gone within seconds. A pin holds one
reference on each of them instead (the block pool never evicts a referenced block): a stored
response's continuation, whose prompt starts with the same tokens, then finds them all.

Pins are a cache hint, never a claim on memory: they end at their expiry, when the front end
unpins them, when the scheduler needs the blocks for live requests (the oldest first, before
any preemption), when a newer pin needs room under the bound, and on a prefix-cache reset.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from folio.core.block_pool import BlockPool, KVCacheBlock


@dataclass
class _Pin:
    blocks: list[KVCacheBlock]
    expiry: float   # time.monotonic() value


class KVPins:
    """Pins by id (the finished request's id), oldest first, holding at most `max_blocks`
    distinct blocks."""

    def __init__(self, block_pool: BlockPool, max_blocks: int) -> None:
        self.block_pool = block_pool
        self.max_blocks = max_blocks
        self._pins: OrderedDict[str, _Pin] = OrderedDict()
        # How many pins hold each block: a continuation's pin repeats the blocks of the
        # response it continued, and the bound counts a block once.
        self._holders: dict[KVCacheBlock, int] = {}
        # The earliest expiry among the pins, so the per-step check is one comparison.
        self._next_expiry = float("inf")

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._holders)

    def pin(self, pin_id: str, blocks: list[KVCacheBlock], expiry: float) -> int:
        """Pin `blocks` (a prefix's blocks, in prefix order) until `expiry`. Older pins give
        way while the bound is exceeded; a pin larger than the bound keeps its leading
        blocks (the prefix a continuation can still hit). Returns the blocks pinned."""
        self.unpin([pin_id])
        while self._pins and self._num_after(blocks) > self.max_blocks:
            self._release(next(iter(self._pins)))
        if self._num_after(blocks) > self.max_blocks:
            blocks = blocks[:self.max_blocks]   # no other pins are left: every block is new
        if not blocks:
            return 0
        self.block_pool.touch(blocks)
        for block in blocks:
            self._holders[block] = self._holders.get(block, 0) + 1
        self._pins[pin_id] = _Pin(blocks, expiry)
        self._next_expiry = min(self._next_expiry, expiry)
        return len(blocks)

    def _num_after(self, blocks: list[KVCacheBlock]) -> int:
        """Distinct pinned blocks once `blocks` are pinned too."""
        holders = self._holders
        return len(holders) + sum(1 for b in blocks if b not in holders)

    def unpin(self, pin_ids: list[str]) -> int:
        """End these pins (ids never pinned, or already ended, are ignored). Returns how
        many ended."""
        ended = 0
        for pin_id in pin_ids:
            if pin_id in self._pins:
                self._release(pin_id)
                ended += 1
        return ended

    def has_expired(self, now: float) -> bool:
        return now >= self._next_expiry

    def expire(self, now: float) -> int:
        """End the pins past their expiry; one comparison while none is due."""
        if now < self._next_expiry:
            return 0
        expired = [pin_id for pin_id, pin in self._pins.items() if pin.expiry <= now]
        for pin_id in expired:
            self._release(pin_id)
        return len(expired)

    def release_oldest(self) -> bool:
        """End the oldest pin, for memory the scheduler needs now; False when none is left."""
        if not self._pins:
            return False
        self._release(next(iter(self._pins)))
        return True

    def clear(self) -> None:
        for pin_id in list(self._pins):
            self._release(pin_id)

    def _release(self, pin_id: str) -> None:
        pin = self._pins.pop(pin_id)
        for block in pin.blocks:
            count = self._holders[block] - 1
            if count:
                self._holders[block] = count
            else:
                del self._holders[block]
        # Tail first, as a request frees its blocks: the shared prefix is evicted last.
        self.block_pool.free_blocks(reversed(pin.blocks))
        if pin.expiry <= self._next_expiry:
            self._next_expiry = min((p.expiry for p in self._pins.values()),
                                    default=float("inf"))
