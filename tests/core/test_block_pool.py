"""BlockPool and FreeBlockQueue: accounting, reference counts, prefix-cache index, LRU eviction."""
from __future__ import annotations

import pytest

from folio.core.block_hash import hash_block_tokens
from folio.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def h(i: int) -> bytes:
    """A distinct, deterministic block hash per integer."""
    return hash_block_tokens(None, [i])


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def check(pool: BlockPool) -> None:
    pool.check_invariants()
    # Stronger than check_invariants: every block carrying a hash is the one the index finds,
    # otherwise a later eviction could leave a dangling index entry.
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached_blocks[block.block_hash] is block


# ---- FreeBlockQueue ----------------------------------------------------------------------

def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5

    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    # The neighbours are relinked directly, both ways.
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]

    q.remove(blocks[0])   # head
    q.remove(blocks[4])   # tail
    assert [b.block_id for b in q] == [1, 3]
    assert q.num_free_blocks == 2

    q.append(blocks[4])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free_blocks == 2


def test_free_queue_rejects_bad_links():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(AssertionError):
        q.append(blocks[0])            # already in the queue
    q.remove(blocks[0])
    with pytest.raises(AssertionError):
        q.remove(blocks[0])            # not in the queue any more
    q.popleft()
    with pytest.raises(RuntimeError):
        q.popleft()                    # empty
    assert q.num_free_blocks == 0


class LinkCountingBlock(KVCacheBlock):
    """A block that counts every read and write of its free-queue links, on any instance."""

    link_accesses = 0

    def __getattribute__(self, name):
        if name in ("prev_free", "next_free"):
            LinkCountingBlock.link_accesses += 1
        return super().__getattribute__(name)

    def __setattr__(self, name, value):
        if name in ("prev_free", "next_free"):
            LinkCountingBlock.link_accesses += 1
        super().__setattr__(name, value)


def link_accesses_of_removal(queue_length: int) -> int:
    """Links touched by removing one block from the middle of a queue of `queue_length`."""
    blocks = [LinkCountingBlock(i) for i in range(queue_length)]
    q = FreeBlockQueue(blocks)
    middle = blocks[queue_length // 2]
    LinkCountingBlock.link_accesses = 0
    q.remove(middle)
    accesses = LinkCountingBlock.link_accesses
    assert middle.prev_free is None and middle.next_free is None
    assert [b.block_id for b in q] == [b.block_id for b in blocks if b is not middle]
    return accesses


def test_free_queue_removal_is_constant_time():
    # Removing from the middle must not walk the list: it touches the block and its two
    # neighbours only, so the work is the same in a short queue and a long one.
    short, long = link_accesses_of_removal(4), link_accesses_of_removal(10_000)
    assert short == long <= 8


# ---- BlockPool accounting ----------------------------------------------------------------

def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_and_free_accounting():
    pool = BlockPool(6)
    check(pool)
    assert pool.num_free_blocks == 6 and pool.usage == 0.0

    a = pool.get_new_blocks(2)
    check(pool)
    assert [b.block_id for b in a] == [0, 1]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 4
    assert pool.usage == pytest.approx(2 / 6)

    b = pool.get_new_blocks(4)
    check(pool)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    check(pool)

    pool.free_blocks(a)
    check(pool)
    assert pool.num_free_blocks == 2
    pool.free_blocks(b)
    check(pool)
    assert pool.num_free_blocks == 6
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)


def test_asking_for_too_many_blocks_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    before = free_ids(pool)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == before
    check(pool)


def test_double_free_asserts():
    pool = BlockPool(2)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])
    check(pool)


def test_shared_block_is_freed_once_per_reference():
    pool = BlockPool(3)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_block(block, h(1))
    pool.touch([block])               # a second owner
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    check(pool)
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    check(pool)
    assert block.ref_cnt == 0 and block.block_id in free_ids(pool)


# ---- prefix-cache index ------------------------------------------------------------------

def test_cache_full_block_first_one_wins():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(1))    # same content computed twice at once
    check(pool)
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None
    # Caching an already cached block again under another hash is ignored.
    pool.cache_full_block(a, h(2))
    assert a.block_hash == h(1) and pool.get_cached_block(h(2)) is None
    check(pool)


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None
    check(pool)


def test_hit_on_free_cached_block_takes_it_off_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[1], h(1))
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4

    hit = pool.get_cached_block(h(1))
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    check(pool)
    assert hit.ref_cnt == 1
    assert hit.block_id not in free_ids(pool)
    assert pool.num_free_blocks == 3
    # And it is not handed out while in use, even when everything else is taken.
    others = pool.get_new_blocks(3)
    assert hit not in others
    assert hit.block_hash == h(1) and pool.get_cached_block(h(1)) is hit
    check(pool)


def test_touch_on_used_block_only_adds_a_reference():
    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_block(a, h(1))
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    check(pool)


# ---- eviction order ----------------------------------------------------------------------

def test_lru_blocks_freed_earlier_are_reused_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, h(i))
    # Free in the order 2, 0, 3, 1: that is the order they come back out.
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
        check(pool)
    assert free_ids(pool) == [2, 0, 3, 1]
    reused = pool.get_new_blocks(2)
    assert [b.block_id for b in reused] == [2, 0]
    # Reuse evicts: the index forgets them, the others are still found.
    assert pool.get_cached_block(h(2)) is None and pool.get_cached_block(h(0)) is None
    assert pool.get_cached_block(h(3)) is blocks[3] and pool.get_cached_block(h(1)) is blocks[1]
    assert all(b.block_hash is None for b in reused)
    assert pool.num_evictions == 2
    check(pool)


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[0], h(0))
    pool.cache_full_block(blocks[2], h(2))
    # Cached ones are freed first, yet the uncached ones go out first.
    pool.free_blocks([blocks[0], blocks[2]])
    pool.free_blocks([blocks[1], blocks[3]])
    check(pool)
    first_two = {b.block_id for b in pool.get_new_blocks(2)}
    assert first_two == {1, 3}
    assert pool.num_evictions == 0
    assert pool.get_cached_block(h(0)) is blocks[0]
    check(pool)


def test_tail_blocks_are_evicted_before_prefix_blocks():
    # A request frees its blocks tail first (the KV cache manager passes them reversed), so the
    # shared-looking prefix outlives its private suffix.
    pool = BlockPool(3)
    request_blocks = pool.get_new_blocks(3)
    for i, block in enumerate(request_blocks):
        pool.cache_full_block(block, h(i))
    pool.free_blocks(reversed(request_blocks))
    check(pool)
    [victim] = pool.get_new_blocks(1)
    assert victim is request_blocks[2]
    assert pool.get_cached_block(h(0)) is request_blocks[0]
    assert pool.get_cached_block(h(1)) is request_blocks[1]


def test_freed_again_after_a_hit_moves_to_the_back():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, h(i))
    pool.free_blocks(blocks)                 # queue: 0, 1, 2
    pool.touch([pool.get_cached_block(h(0))])
    pool.free_blocks([blocks[0]])            # recently used again: queue 1, 2, 0
    check(pool)
    assert free_ids(pool) == [1, 2, 0]


# ---- reset_prefix_cache ------------------------------------------------------------------

def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], h(0))
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is False
    # Nothing was forgotten.
    assert pool.get_cached_block(h(0)) is blocks[0]
    check(pool)

    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is True
    check(pool)
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(h(0)) is None
    assert pool.num_free_blocks == 3
