"""The data-parallel router (folio/engine/dp_router.py): a prompt goes to the replica holding
its longest remembered prefix unless that one is overloaded, else to the least loaded; dead
replicas and other salts are never matched; memory is bounded."""
from __future__ import annotations

import pytest

from folio.engine.dp_router import PrefixAwareRouter, ReplicaLoad, Route


def _loads(*open_requests, alive=None, kv=None):
    alive = alive or [True] * len(open_requests)
    kv = kv or [0.0] * len(open_requests)
    return [ReplicaLoad(a, n, k) for a, n, k in zip(alive, open_requests, kv)]


def test_least_loaded_then_kv_use_then_index():
    router = PrefixAwareRouter(block_size=4)
    assert router.choose([1, 2, 3], _loads(3, 1, 2)) == Route(1, 0)
    assert router.choose([1, 2, 3], _loads(1, 1, kv=[0.5, 0.2])) == Route(1, 0)
    assert router.choose([1, 2, 3], _loads(0, 0)) == Route(0, 0)


def test_a_shared_prefix_follows_its_replica():
    router = PrefixAwareRouter(block_size=4)
    shared = list(range(100, 140))          # ten full blocks
    router.record(shared + [1, 2], replica=1)
    route = router.choose(shared + [7, 8, 9, 10, 11], _loads(0, 3))
    assert route == Route(1, 40)
    # the longest remembered prefix wins
    router.record(shared[:8], replica=0)
    assert router.choose(shared[:8] + [5] * 8, _loads(0, 0)).replica == 0
    assert router.choose(shared, _loads(0, 0)) == Route(1, 40)


def test_an_overloaded_holder_loses_to_the_least_loaded():
    router = PrefixAwareRouter(block_size=4, overload_slack=2)
    router.record(list(range(16)), replica=0)
    assert router.choose(list(range(16)), _loads(4, 1)) == Route(0, 16)   # 4 <= 2*1 + 2
    assert router.choose(list(range(16)), _loads(5, 1)) == Route(1, 0)


def test_dead_replicas_and_other_salts_never_match():
    router = PrefixAwareRouter(block_size=4)
    router.record(list(range(16)), replica=1, salt="a")
    assert router.choose(list(range(16)), _loads(0, 0), salt="b") == Route(0, 0)
    assert router.choose(list(range(16)), _loads(0, 0, alive=[True, False]), salt="a") \
        == Route(0, 0)
    router.forget_replica(1)
    assert router.choose(list(range(16)), _loads(0, 0), salt="a") == Route(0, 0)
    with pytest.raises(ValueError, match="no data-parallel replica"):
        router.choose([1], _loads(0, 0, alive=[False, False]))


def test_memory_is_bounded():
    router = PrefixAwareRouter(block_size=2, max_entries=10)
    for i in range(50):
        router.record([i, i, i, i], replica=i % 2)
    assert len(router._owner) == 10
    # text prompts hash alike (characters as tokens)
    router.record("hello world, hello", replica=1)
    assert router.choose("hello world, hello again", _loads(0, 0)).replica == 1
