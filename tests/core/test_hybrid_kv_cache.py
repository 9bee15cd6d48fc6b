"""KV cache groups (sliding-window layers beside full ones): the layout, and the hybrid
manager's block tables — blocks freed out of a window, the null block, prefix hits that need
only the window's blocks, preemption and capacity."""
from __future__ import annotations

from folio.core.kv_cache_layout import KVCacheGroup, full_attention_layout, kv_cache_layout
from folio.core.kv_cache_manager import (HybridKVCacheManager, KVCacheManager,
                                         make_kv_cache_manager)
from folio.core.request import Request
from folio.sampling_params import SamplingParams

BS = 4
W = 8   # window: a query sees itself and the 7 positions before it


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=512, temperature=0),
                   block_size=BS, max_model_len=1024)


def hybrid(num_blocks: int = 64, windows: tuple = (W, None, W)) -> HybridKVCacheManager:
    kv = make_kv_cache_manager(kv_cache_layout(windows, len(windows)), num_blocks, BS)
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def prefill(kv: KVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def decode(kv: KVCacheManager, req: Request, steps: int) -> None:
    for _ in range(steps):
        req.append_output_token(100 + req.num_tokens)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def held(kv: KVCacheManager) -> int:
    return kv.block_pool.num_usable_blocks - kv.block_pool.num_free_blocks


# ---- layout ------------------------------------------------------------------------------

def test_layout_of_uniform_models_is_one_group():
    assert kv_cache_layout((None,) * 4, 4) == full_attention_layout(4)
    assert kv_cache_layout((), 3).is_single_full
    sliding = kv_cache_layout((16,) * 3, 3)
    assert sliding.groups == (KVCacheGroup((0, 1, 2), 16),) and sliding.group_size == 3
    assert not sliding.is_single_full and sliding.num_reserved_blocks == 1


def test_a_window_as_long_as_the_context_is_full_attention():
    assert kv_cache_layout((16, None, 16), 3, max_model_len=16).is_single_full
    assert kv_cache_layout((16, None, 16), 3, max_model_len=17).num_groups == 3
    assert kv_cache_layout((32, None, 16), 3, max_model_len=20).groups == (
        KVCacheGroup((0,), None), KVCacheGroup((1,), None), KVCacheGroup((2,), 16))


def test_layout_of_interleaved_layers_groups_by_type_full_first():
    layout = kv_cache_layout((16, None, 16), 3)
    assert layout.group_size == 1
    assert layout.groups == (KVCacheGroup((1,), None), KVCacheGroup((0,), 16),
                             KVCacheGroup((2,), 16))
    assert layout.layer_placement(3) == [(1, 0), (0, 0), (2, 0)]


def test_layout_pads_the_last_group_of_a_type():
    # Gemma 3 1B's pattern: every sixth of 26 layers is full (4 full, 22 sliding).
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    layout = kv_cache_layout(windows, 26)
    assert layout.group_size == 4
    sizes = [len(g.layers) for g in layout.groups]
    assert sizes == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(26))
    assert all(len({windows[i] for i in g.layers}) == 1 for g in layout.groups)


def test_blocks_per_sequence_bounds_sliding_groups():
    layout = kv_cache_layout((W, None, W), 3)
    # 100 tokens: the full group 25 blocks; each sliding group the window's 7 keys and the
    # step's token, at most 3 blocks.
    assert layout.blocks_per_sequence(100, BS) == 25 + 2 * 3
    assert layout.blocks_per_sequence(4, BS) == 3
    assert full_attention_layout(2).blocks_per_sequence(100, BS) == 25


# ---- freeing out of the window -----------------------------------------------------------

def test_a_long_sequence_holds_fewer_blocks_in_a_sliding_group():
    full, sliding = KVCacheManager(64, BS), hybrid(windows=(W, W))
    for kv in (full, sliding):
        req = make_request("a", list(range(10)))
        prefill(kv, req)
        decode(kv, req, 90)
    assert held(full) == 25
    # w - 1 keys before the next query plus itself span at most 3 blocks (one in allocation).
    assert held(sliding) <= 3


def test_freed_blocks_become_the_null_block_and_keep_their_hash():
    kv = hybrid(windows=(W, None))
    null = kv.block_pool.null_block
    assert null is not None and null.block_id == 0
    req = make_request("a", list(range(40)))
    prefill(kv, req)
    decode(kv, req, 1)
    full_ids, sliding_ids = kv.get_block_ids("a")
    assert 0 not in full_ids and len(full_ids) == len(sliding_ids) == 11
    # Position 40 reads keys from 33 on: blocks 0..7 are gone from the sliding table.
    assert sliding_ids[:8] == [0] * 8 and 0 not in sliding_ids[8:]
    freed = [kv.block_pool.blocks[i] for i in range(1, kv.block_pool.num_blocks)
             if kv.block_pool.blocks[i].ref_cnt == 0 and kv.block_pool.blocks[i].block_hash]
    assert len(freed) == 8    # cached, free, findable by the prefix cache
    kv.block_pool.check_invariants()


def test_the_null_block_is_never_handed_out_nor_freed():
    kv = hybrid(num_blocks=9, windows=(W,))
    reqs = [make_request(f"r{i}", list(range(i * 100, i * 100 + 12))) for i in range(2)]
    for req in reqs:
        prefill(kv, req)
    for req in reqs:
        decode(kv, req, 30)
        assert kv.block_pool.null_block.block_id not in kv.get_block_ids(req.request_id)[0][-3:]
    for req in reqs:
        kv.free(req)
    pool = kv.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks == 8 and pool.null_block.ref_cnt == 1
    assert pool.null_block not in list(pool.free_queue)
    assert pool.usage == 0.0
    pool.check_invariants()


# ---- prefix hits ---------------------------------------------------------------------------

def test_prefix_hit_needs_only_the_window_of_a_sliding_group():
    kv = hybrid(windows=(W, None))
    a = make_request("a", list(range(41)))
    prefill(kv, a)
    kv.free(a)
    b = make_request("b", list(range(41)))
    hits, num = kv.get_computed_blocks(b)
    assert num == 40
    full_hits, sliding_hits = hits
    null = kv.block_pool.null_block
    assert len(full_hits) == len(sliding_hits) == 10 and null not in full_hits
    # Token 40 sees keys 33..40: blocks 8 and 9 only.
    assert sliding_hits[:8] == [null] * 8 and null not in sliding_hits[8:]
    assert prefill(kv, make_request("c", list(range(41)))) == 40
    kv.block_pool.check_invariants()


def test_prefix_hit_shrinks_to_a_missing_window_block():
    kv = hybrid(windows=(W, None))
    a = make_request("a", list(range(41)))
    prefill(kv, a)
    sliding = kv.req_to_blocks["a"][1]
    kv.free(a)
    # Evict the sliding group's block 9: no prefix past 36 has its window; 36 needs blocks
    # 7 and 8 (keys 29..35), which are there.
    kv.block_pool.uncache_block(sliding[9])
    assert kv.get_computed_blocks(make_request("b", list(range(41))))[1] == 36
    # Evicting block 7 too: 36 fails, and so does every prefix whose window holds block 7,
    # up to 32 + 3; 28 (keys 21..27, blocks 5 and 6) works.
    kv.block_pool.uncache_block(sliding[7])
    hits, num = kv.get_computed_blocks(make_request("b", list(range(41))))
    assert num == 28 and len(hits[0]) == len(hits[1]) == 7


def test_prefix_hit_only_where_every_full_group_has_the_blocks():
    kv = hybrid(windows=(W, None, None))   # two full groups (of one layer each), one sliding
    a = make_request("a", list(range(41)))
    prefill(kv, a)
    second_full = kv.req_to_blocks["a"][1]
    kv.free(a)
    kv.block_pool.uncache_block(second_full[3])
    assert kv.get_computed_blocks(make_request("b", list(range(41))))[1] == 12


def test_a_hit_is_the_same_groups_block_at_the_same_index():
    kv = hybrid(windows=(W, None))
    a = make_request("a", list(range(41)))
    prefill(kv, a)
    hits, num = kv.get_computed_blocks(make_request("b", list(range(41))))
    assert num == 40
    tables = kv.req_to_blocks["a"]
    null = kv.block_pool.null_block
    for g in range(2):
        assert all(b is tables[g][i] for i, b in enumerate(hits[g]) if b is not null)


# ---- preemption and capacity ---------------------------------------------------------------

def test_free_returns_every_block_of_every_group():
    kv = hybrid()
    reqs = [make_request(f"r{i}", list(range(i * 50, i * 50 + 30))) for i in range(3)]
    for req in reqs:
        prefill(kv, req)
        decode(kv, req, 10)
    assert held(kv) > 0
    for req in reqs:
        kv.free(req)
    assert held(kv) == 0 and kv.req_to_blocks == {} and kv.req_to_block_ids == {}
    kv.block_pool.check_invariants()


def test_allocation_needs_room_for_every_group_or_changes_nothing():
    kv = hybrid(num_blocks=8, windows=(W, None))   # 7 usable blocks
    req = make_request("a", list(range(16)))       # 4 blocks in each group
    assert kv.allocate_slots(req, 16) is None
    assert kv.req_to_blocks == {} and held(kv) == 0
    small = make_request("b", list(range(12)))     # 3 + 3
    assert kv.allocate_slots(small, 12) is not None and held(kv) == 6
    kv.block_pool.check_invariants()


def test_lookahead_slots_are_allocated_in_every_group():
    kv = hybrid(windows=(W, None))
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6, num_lookahead_tokens=3) is not None
    assert [len(ids) for ids in kv.get_block_ids("a")] == [3, 3]


def test_token_capacity_counts_every_group():
    layout = kv_cache_layout((W, None, W), 3)
    assert layout.token_capacity(31, BS) == 30 * BS // 3
    assert full_attention_layout(3).token_capacity(31, BS) == 31 * BS
