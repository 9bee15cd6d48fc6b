"""The host KV tier's pool (folio/worker/host_kv_pool.py) on the CPU: blocks saved to host
slots come back bit for bit into other device blocks, whatever runs of consecutive slots the
pairs make, and a step's saves and loads together leave what the saves then the loads in
order would (tests/gpu/test_gpu_host_kv_pool.py: the same on a GPU's streams)."""
from __future__ import annotations

import pytest
import torch

from folio.worker.host_kv_pool import HostKVPool, _chunks, _runs


def test_runs_of_consecutive_slots():
    pairs = [(2, 9), (3, 4), (4, 1), (7, 0), (9, 3), (10, 8)]
    assert _runs(pairs) == [(0, 2, 3), (3, 7, 1), (4, 9, 2)]


def test_chunks_of_runs():
    runs = [(0, 2, 3), (3, 7, 1), (4, 9, 2)]
    assert _chunks(runs, 10) == [(0, runs)]
    assert _chunks(runs, 2) == [(0, [(0, 2, 2)]), (2, [(0, 4, 1), (1, 7, 1)]),
                                (4, [(0, 9, 2)])]
    assert _chunks(runs, 1) == [(i, [(0, s, 1)]) for i, s in enumerate([2, 3, 4, 7, 9, 10])]


@pytest.mark.parametrize("chunk_slots", [None, 2])
def test_saved_blocks_load_back_bit_for_bit(chunk_slots):
    """Slot-major host memory (a slot's blocks of every layer in one range); copies staged in
    chunks of slots (`chunk_slots`: as the pool cuts a long prefix)."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 12, 4, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]
    pool = HostKVPool(caches, num_slots=10)
    assert tuple(pool.slots.shape) == (10, 3, 2, 4, 2, 8)
    if chunk_slots is not None:
        pool._chunk_slots = chunk_slots
    saves = [(5, 3), (1, 4), (7, 5), (0, 9), (11, 0)]          # (device block, host slot)
    pool.save(caches, saves)
    want = [c.clone() for c in caches]
    for c in caches:
        c.zero_()
    loads = [(9, 2), (3, 8), (4, 7), (5, 6), (0, 1)]           # (host slot, device block)
    assert pool.load(caches, loads) is None                     # on the CPU: done on return
    by_slot = {slot: block for block, slot in saves}
    for layer, cache in enumerate(caches):
        for slot, block in loads:
            assert torch.equal(cache[:, block], want[layer][:, by_slot[slot]])
            assert torch.equal(pool.host[layer][slot], want[layer][:, by_slot[slot]])
        untouched = sorted(set(range(12)) - {b for _, b in loads})
        assert not cache[:, untouched].any()


def test_a_steps_saves_and_loads_into_the_blocks_it_saved():
    """`transfer`: the blocks a host hit loads into are the ones just evicted, saved in the
    same step; the host slots get the blocks' old contents and the blocks the loaded ones
    (on a GPU as a pipeline, tests/gpu/test_gpu_host_kv_pool.py; here in order)."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, 8, 4, 2, 8, generator=gen) for _ in range(2)]
    pool = HostKVPool(caches, num_slots=6)
    pool.save(caches, [(0, 0), (1, 1)])                       # a prefix saved earlier
    prefix = [c[:, [0, 1]].clone() for c in caches]
    for c in caches:
        c[:, [0, 1]] = torch.randn(2, 2, 4, 2, 8, generator=gen)   # the blocks reused since
    old = [c[:, [5, 6]].clone() for c in caches]
    assert pool.transfer(caches, saves=[(5, 3), (6, 2)], loads=[(0, 5), (1, 6)]) is None
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, [5, 6]], prefix[layer])
        assert torch.equal(pool.host[layer][[3, 2]].transpose(0, 1), old[layer])
