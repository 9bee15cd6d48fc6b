"""Block hash chains on requests, and KVCacheManager: prefix hits, allocation, sharing, freeing."""
from __future__ import annotations

import pytest

from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request
from folio.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(rid: str, tokens: list[int], *, block_size: int = BS, max_model_len: int = 1024,
                 cache_salt: str | None = None, extra_hash_keys: tuple = (),
                 **params) -> Request:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0)
    return Request(rid, tokens, SamplingParams(**params), block_size=block_size,
                   max_model_len=max_model_len, cache_salt=cache_salt,
                   extra_hash_keys=extra_hash_keys)


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    """Schedule the whole prompt as a scheduler would; returns the number of hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


# ---- hash chain --------------------------------------------------------------------------

def test_equal_prefixes_give_equal_hashes():
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(8)) + [99, 98, 97])
    assert len(a.block_hashes) == 2 and len(b.block_hashes) == 2
    assert a.block_hashes == b.block_hashes
    c = make_request("c", list(range(8)) + [99, 98, 97, 96])
    assert c.block_hashes[:2] == a.block_hashes and len(c.block_hashes) == 3


def test_change_in_first_block_changes_every_hash():
    base = list(range(16))
    a = make_request("a", base)
    b = make_request("b", [1000] + base[1:])
    assert len(a.block_hashes) == len(b.block_hashes) == 4
    # Later blocks have identical tokens, but the chain carries the difference.
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))


def test_change_in_a_later_block_keeps_earlier_hashes():
    base = list(range(16))
    a = make_request("a", base)
    b = make_request("b", base[:9] + [1000] + base[10:])
    assert a.block_hashes[:2] == b.block_hashes[:2]
    assert a.block_hashes[2] != b.block_hashes[2] and a.block_hashes[3] != b.block_hashes[3]


def test_cache_salt_changes_every_hash():
    tokens = list(range(12))
    plain = make_request("p", tokens)
    salted = make_request("s", tokens, cache_salt="tenant-a")
    other = make_request("o", tokens, cache_salt="tenant-b")
    empty = make_request("e", tokens, cache_salt="")
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes))
    assert all(x != y for x, y in zip(salted.block_hashes, other.block_hashes))
    assert all(x != y for x, y in zip(plain.block_hashes, empty.block_hashes))
    same = make_request("s2", tokens, cache_salt="tenant-a")
    assert same.block_hashes == salted.block_hashes


def test_extra_hash_keys_change_every_hash():
    tokens = list(range(8))
    a = make_request("a", tokens, extra_hash_keys=("adapter-1",))
    b = make_request("b", tokens, extra_hash_keys=("adapter-2",))
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))
    assert make_request("c", tokens, extra_hash_keys=("adapter-1",)).block_hashes == a.block_hashes


def test_partial_blocks_are_not_hashed():
    assert make_request("a", [1, 2, 3]).block_hashes == []
    assert len(make_request("b", list(range(7))).block_hashes) == 1
    assert len(make_request("c", list(range(8))).block_hashes) == 2


def test_hashes_extend_as_output_tokens_arrive():
    req = make_request("a", list(range(6)))
    assert len(req.block_hashes) == 1
    req.append_output_token(6)
    assert len(req.block_hashes) == 1
    req.append_output_token(7)
    assert len(req.block_hashes) == 2
    # The hash of a block completed by output tokens equals that of a prompt holding them.
    assert req.block_hashes == make_request("b", list(range(8))).block_hashes
    for t in range(8, 13):
        req.append_output_token(t)
    assert len(req.block_hashes) == 3
    assert req.block_hashes == make_request("c", list(range(13))).block_hashes


# ---- prefix hits -------------------------------------------------------------------------

def test_prefix_hit_counts():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", list(range(10)))
    assert run_prefill(kv, first) == 0
    # 10 tokens: blocks 0 and 1 are full and cached, block 2 is partial.
    second = make_request("b", list(range(10)) + [50, 51])
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8 and blocks == kv.req_to_blocks["a"][:2]
    # A diverging prefix hits only up to the divergence.
    third = make_request("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert kv.get_computed_blocks(third)[1] == 4
    # A different salt hits nothing.
    salted = make_request("d", list(range(10)), cache_salt="x")
    assert kv.get_computed_blocks(salted) == ([], 0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_last_prompt_token_is_always_recomputed(k: int):
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(k * BS))
    run_prefill(kv, make_request("a", tokens))
    assert len(kv.block_pool.cached_blocks) == k
    # Exactly k full blocks: all are cached, yet at most k-1 may be hit.
    blocks, num_hit = kv.get_computed_blocks(make_request("b", tokens))
    assert len(blocks) == k - 1 and num_hit == (k - 1) * BS
    # One more token and all k blocks are usable.
    blocks, num_hit = kv.get_computed_blocks(make_request("c", tokens + [7]))
    assert len(blocks) == k and num_hit == k * BS


def test_prompt_logprobs_requests_never_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_request("a", list(range(12))))
    req = make_request("b", list(range(13)), prompt_logprobs=1)
    assert kv.get_computed_blocks(req) == ([], 0)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    run_prefill(kv, make_request("a", list(range(12))))
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([], 0)


def test_hit_on_freed_blocks_after_the_owner_finished():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    a_blocks = list(kv.req_to_blocks["a"])
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_request("b", list(range(9)))
    assert run_prefill(kv, b) == 8
    assert kv.req_to_blocks["b"][:2] == a_blocks[:2]
    assert kv.num_free_blocks == 8 - 3
    kv.block_pool.check_invariants()


def test_record_lookup_stats():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.stats.hit_rate == 0.0
    kv.record_lookup(make_request("a", list(range(10))), 0)
    kv.record_lookup(make_request("b", list(range(10))), 8)
    assert (kv.stats.requests, kv.stats.queries, kv.stats.hits) == (2, 20, 8)
    assert kv.stats.hit_rate == pytest.approx(0.4)


# ---- allocation --------------------------------------------------------------------------

def test_allocate_slots_grows_block_by_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(5)))
    new = kv.allocate_slots(req, 5)
    assert new is not None and len(new) == 2
    req.num_computed_tokens = 5
    for t in range(5, 8):          # decodes filling block 1
        req.append_output_token(t)
        assert kv.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    req.append_output_token(8)     # the ninth token needs a third block
    assert len(kv.allocate_slots(req, 1)) == 1
    assert len(kv.get_block_ids("a")[0]) == 3
    kv.block_pool.check_invariants()


def test_blocks_are_cached_when_full():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(7)))
    kv.allocate_slots(req, 7)
    req.num_computed_tokens = 7
    blocks = kv.req_to_blocks["a"]
    assert blocks[0].block_hash == req.block_hashes[0] and blocks[1].block_hash is None
    req.append_output_token(7)
    kv.allocate_slots(req, 1)
    assert blocks[1].block_hash == req.block_hashes[1]
    assert kv.block_pool.get_cached_block(req.block_hashes[1]) is blocks[1]


def test_chunked_allocation_caches_only_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(14)))
    kv.allocate_slots(req, 6)           # first chunk: block 0 full, block 1 half
    req.num_computed_tokens = 6
    assert len(kv.block_pool.cached_blocks) == 1
    kv.allocate_slots(req, 8)           # rest: blocks 1, 2 full, block 3 partial
    req.num_computed_tokens = 14
    assert len(kv.block_pool.cached_blocks) == 3
    assert len(kv.req_to_blocks["a"]) == 4


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    holder = make_request("holder", list(range(100, 109)))     # 3 blocks
    kv.allocate_slots(holder, 9)
    req = make_request("a", list(range(9)))
    state = (kv.num_free_blocks, [b.block_id for b in kv.block_pool.free_queue],
             dict(kv.block_pool.cached_blocks), [b.ref_cnt for b in kv.block_pool.blocks])
    assert kv.allocate_slots(req, 9) is None
    assert "a" not in kv.req_to_blocks
    assert state == (kv.num_free_blocks, [b.block_id for b in kv.block_pool.free_queue],
                     dict(kv.block_pool.cached_blocks), [b.ref_cnt for b in kv.block_pool.blocks])
    kv.block_pool.check_invariants()
    # A request that holds blocks and fails to grow keeps exactly what it had.
    kv.allocate_slots(req, 4)
    req.num_computed_tokens = 4
    held = kv.get_block_ids("a")
    assert kv.allocate_slots(req, 5) is None
    assert kv.get_block_ids("a") == held
    kv.block_pool.check_invariants()


def test_hits_on_free_blocks_count_against_free_space():
    # The free cached blocks a request hits leave the free queue, so they cannot also serve
    # as its new blocks.
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)            # 3 blocks, 2 cached
    kv.free(a)
    b = make_request("b", list(range(9)) + list(range(50, 61)))   # 20 tokens, 5 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # Needs 3 more blocks; 4 are free but 2 of them are the hits themselves.
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert kv.num_free_blocks == 4
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is not None
    kv.block_pool.check_invariants()
    # 16 tokens need only 2 new blocks: exactly the 4 free minus the 2 hits.
    c = make_request("c", list(range(9)) + list(range(50, 57)))   # 16 tokens, 4 blocks
    hits, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, hits) is not None
    assert kv.num_free_blocks == 0
    kv.block_pool.check_invariants()


def test_shared_blocks_have_two_references_and_free_once_each():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(10)))
    run_prefill(kv, a)
    assert run_prefill(kv, b) == 8
    shared = kv.req_to_blocks["a"][:2]
    assert kv.req_to_blocks["b"][:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    # Each has its own partial tail.
    assert kv.req_to_blocks["a"][2] is not kv.req_to_blocks["b"][2]
    assert kv.num_free_blocks == 8 - 4
    kv.block_pool.check_invariants()

    kv.free(a)
    kv.block_pool.check_invariants()
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert kv.num_free_blocks == 8 - 3
    kv.free(b)
    kv.block_pool.check_invariants()
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert kv.num_free_blocks == 8
    # Freeing an unknown (or already freed) request is a no-op, not a double free.
    kv.free(b)
    kv.block_pool.check_invariants()
    assert kv.num_free_blocks == 8


def test_reset_prefix_cache_through_manager():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_free_evicts_a_requests_tail_before_its_prefix():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    blocks = list(kv.req_to_blocks["a"])
    assert all(b.block_hash is not None for b in blocks)
    kv.free(a)
    kv.block_pool.check_invariants()
    [reused] = kv.block_pool.get_new_blocks(1)
    assert reused is blocks[2]
    # The prefix is still found: a request sharing 8 tokens hits both blocks.
    assert kv.get_computed_blocks(make_request("b", list(range(8)) + [77]))[1] == 8
