"""The pool of KV cache blocks: allocation, reference counts, and the prefix-cache index.

Every block exists from start-up; none is created or destroyed later. A block is in exactly
one of two states: in use (ref_cnt > 0, owned by one or more requests) or free (ref_cnt == 0,
in the free queue). A free block may still hold a cached prefix, found through its hash until
the block is handed out again (that is the LRU eviction).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from folio.core.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; None when the block is not in it.
    prev_free: "KVCacheBlock | None" = field(default=None, repr=False)
    next_free: "KVCacheBlock | None" = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, append and removal from the middle
    (a cache hit on a free block takes it out wherever it sits). The head is evicted first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_before(self, block: KVCacheBlock, successor: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        predecessor = successor.prev_free
        assert predecessor is not None
        predecessor.next_free = block
        block.prev_free = predecessor
        block.next_free = successor
        successor.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: evicted last."""
        self._link_before(block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: reused first (blocks holding nothing worth keeping)."""
        assert self._head.next_free is not None
        self._link_before(block, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 null_block: bool = False) -> None:
        """`null_block`: reserve block 0, never handed out, to stand in a sliding-window
        group's table for the blocks freed out of its window (it holds a reference forever)."""
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        if null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1
        # Blocks requests can hold (all but the null block).
        self.num_usable_blocks = num_blocks - null_block
        self.free_queue = FreeBlockQueue(self.blocks[int(null_block):])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # Told of each cached block evicted (its hash and id), before its slot is reused: the
        # host KV tier saves it (folio/core/kv_offload.py). None: nobody listens.
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (held by a request)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block.block_id)
            block.block_hash = None
            self.num_evictions += 1

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop a block from the prefix-cache index: its K/V will never be written after all."""
        if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index a block whose tokens are all known. If an equal block is indexed already (two
        requests computed the same prefix at once), the first stays the one found."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Give blocks in eviction order: the caller passes
        a request's blocks tail first, so a shared prefix outlives its private suffixes."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing to find in it later: hand it out before any cached block.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (False) while any block is in use, since a running
        request's blocks must keep their hashes to be freed consistently."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_invariants(self) -> None:
        """Counts add up: every block is either free (ref 0, in the queue) or in use (ref > 0),
        and every indexed hash points at a block carrying that hash. For tests and debugging."""
        free = list(self.free_queue)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.num_free_blocks, "free queue corrupt"
        for block in self.blocks:
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, f"{block} is free with references"
            else:
                assert block.ref_cnt > 0, f"{block} leaked: not free and unreferenced"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} index mismatch"
