"""KV pins (folio/core/kv_pins.py): a finished request's cached blocks kept out of the prefix
cache's LRU eviction for a time-to-live, driven through the scheduler with test_scheduler's
fake runner, whose KV oracle fails any step that reads a slot not written for its prefix (a
pinned block handed out twice, or a stale hit)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import folio.core.scheduler as scheduler_module
from folio.core.kv_cache_layout import kv_cache_layout
from folio.core.kv_cache_manager import KVCacheManager, make_kv_cache_manager
from folio.core.request import Request, RequestStatus
from folio.core.scheduler import Scheduler
from folio.sampling_params import SamplingParams
from test_scheduler import BS, EOS, FakeRunner, assert_all_free, check_step, step

TTL = 3600.0


def make_scheduler(num_blocks: int, fraction: float = 1.0, *, budget: int = 64,
                   windows: tuple[int | None, ...] = (), max_model_len: int = 256) -> Scheduler:
    kv = (make_kv_cache_manager(kv_cache_layout(windows, len(windows)), num_blocks, BS,
                                max_pinned_fraction=fraction)
          if windows else KVCacheManager(num_blocks, BS, max_pinned_fraction=fraction))
    return Scheduler(kv_cache_manager=kv, max_num_seqs=8, max_num_batched_tokens=budget,
                     max_model_len=max_model_len)


def request(rid: str, prompt: list[int], *, max_tokens: int = 3, pin: float | None = TTL,
            max_model_len: int = 256) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), (EOS,),
                   block_size=BS, max_model_len=max_model_len, kv_pin_ttl=pin)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def drain(sched: Scheduler, runner: FakeRunner) -> None:
    """Step until no request is left (pins may still hold blocks)."""
    while sched.has_unfinished_requests():
        step(sched, runner)


def run(sched: Scheduler, runner: FakeRunner, *requests: Request) -> None:
    for r in requests:
        sched.add_request(r)
    drain(sched, runner)


def hit(sched: Scheduler, runner: FakeRunner, req: Request) -> int:
    """Run a request alone; the prompt tokens it found in the prefix cache."""
    run(sched, runner, req)
    return req.num_cached_tokens


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The scheduler's monotonic clock, set by the test."""
    now = [1000.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def flush(sched: Scheduler, runner: FakeRunner) -> None:
    """Unrelated short requests, one after another, until the LRU eviction has taken every
    cached block that no pin holds (each request fits beside the pins: none is released)."""
    pool = sched.kv.block_pool
    pinned = sched.kv.pins._holders
    old = {h for h, b in pool.cached_blocks.items() if b not in pinned}
    for n in range(1000):
        if not old & pool.cached_blocks.keys():
            return
        run(sched, runner, request(f"flood{n}", tokens(10_000 + 64 * n, 2 * BS - 1),
                                   max_tokens=1, pin=None))
        assert len(sched.kv.pins) > 0
    raise AssertionError("the flood evicted nothing")


def test_pinned_blocks_survive_eviction_and_a_continuation_hits_them():
    sched = make_scheduler(16)
    runner = FakeRunner()
    pinned = request("a", tokens(100, 10))              # 10 + 3 tokens: 12 computed
    unpinned = request("u", tokens(200, 10), pin=None)
    run(sched, runner, pinned, unpinned)
    assert sched.stats().num_pinned_blocks == 3
    flush(sched, runner)
    assert sched.kv.block_pool.num_evictions > 0
    # The continuations: each conversation so far, then a new turn.
    assert hit(sched, runner, request("a2", pinned.all_token_ids + [7, 8, 9], pin=None)) == 12
    assert hit(sched, runner, request("u2", unpinned.all_token_ids + [7, 8, 9], pin=None)) == 0
    sched.unpin_kv(["a"])
    assert_all_free(sched)


def test_pins_expire(clock: list[float]):
    sched = make_scheduler(16)
    runner = FakeRunner()
    first = request("a", tokens(100, 10), pin=30.0)
    run(sched, runner, first)
    run(sched, runner, request("b", tokens(200, 10), pin=60.0))
    assert sched.stats().num_pinned_blocks == 6
    assert not sched.has_expired_pins(clock[0] + 29.0)
    clock[0] += 31.0
    assert sched.has_expired_pins(clock[0])
    sched.schedule()                                   # every step checks first
    assert list(sched.kv.pins._pins) == ["b"]
    assert not sched.has_expired_pins(clock[0]) and sched.has_expired_pins(clock[0] + 30.0)
    # Expired, the blocks are ordinary cached blocks again: other traffic evicts them.
    flush(sched, runner)
    assert hit(sched, runner, request("a2", first.all_token_ids + [1], pin=None)) == 0
    clock[0] += 30.0
    sched.schedule()
    assert_all_free(sched)


def test_unpin_frees_and_ignores_unknown_ids():
    sched = make_scheduler(16)
    runner = FakeRunner()
    run(sched, runner, request("a", tokens(100, 10)), request("b", tokens(200, 10)))
    assert sched.unpin_kv(["a", "nope"]) == 1
    assert sched.stats().num_pinned_blocks == 3
    assert sched.unpin_kv(["a"]) == 0
    assert sched.unpin_kv(["b"]) == 1
    assert_all_free(sched)


def test_only_complete_outputs_are_pinned():
    sched = make_scheduler(16)
    runner = FakeRunner()
    stopped = request("eos", tokens(100, 10), max_tokens=5)
    runner.next_token = lambda req: EOS if req.num_output_tokens == 2 else 1000
    run(sched, runner, stopped)
    assert stopped.status == RequestStatus.FINISHED_STOPPED
    assert len(sched.kv.pins) == 1
    # A stop string (found by the front end) finishes it as stopped: pinned too.
    by_string = request("str", tokens(200, 10), max_tokens=20)
    sched.add_request(by_string)
    step(sched, runner)
    sched.finish_requests(["str"], RequestStatus.FINISHED_STOPPED)
    assert len(sched.kv.pins) == 2
    # Aborted (the client left): not stored, so not pinned.
    aborted = request("abort", tokens(300, 10), max_tokens=20)
    sched.add_request(aborted)
    step(sched, runner)
    sched.abort_requests(["abort"])
    assert len(sched.kv.pins) == 2
    sched.unpin_kv(["eos", "str"])
    assert_all_free(sched)


def test_memory_pressure_releases_pins_before_preempting():
    # 8 blocks, 3 pinned by "old" and 2 by "new": a request that grows to 7 blocks needs
    # both pins' blocks. They give way, and no request is preempted.
    sched = make_scheduler(8)
    runner = FakeRunner()
    run(sched, runner, request("old", tokens(100, 10)))
    run(sched, runner, request("new", tokens(200, 6), max_tokens=3))
    assert sched.stats().num_pinned_blocks == 5
    grows = request("grows", tokens(300, 4), max_tokens=23, pin=None)   # 26 computed: 7 blocks
    run(sched, runner, grows)
    assert grows.num_output_tokens == 23
    assert sched.stats().num_preemptions == 0
    assert len(sched.kv.pins) == 0
    # A waiting request is admitted the same way: pins go, it does not wait.
    run(sched, runner, request("p", tokens(100, 10)))
    big = request("big", tokens(400, 29), max_tokens=1, pin=None)          # 8 blocks
    sched.add_request(big)
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["big"]
    assert len(sched.kv.pins) == 0
    drain(sched, runner)
    assert sched.stats().num_preemptions == 0


def test_the_oldest_pin_goes_first_and_only_as_many_as_needed():
    sched = make_scheduler(10)
    runner = FakeRunner()
    run(sched, runner, request("old", tokens(100, 10)))              # 3 blocks
    new = request("new", tokens(200, 10))                            # 3 blocks
    run(sched, runner, new)
    # 4 free; 6 blocks needed: "old" gives its 3 back, "new" stays.
    run(sched, runner, request("x", tokens(300, 22), max_tokens=1, pin=None))
    assert list(sched.kv.pins._pins) == ["new"]
    assert sched.stats().num_preemptions == 0
    flush(sched, runner)
    assert hit(sched, runner, request("new2", new.all_token_ids + [1], pin=None)) == 12


def test_the_bound_holds():
    # A quarter of 16 blocks: 4 pinned at most.
    sched = make_scheduler(16, fraction=0.25)
    runner = FakeRunner()
    run(sched, runner, request("a", tokens(100, 10)))                # 3 blocks
    run(sched, runner, request("b", tokens(200, 10)))                # 3 more: "a" goes
    assert list(sched.kv.pins._pins) == ["b"] and sched.stats().num_pinned_blocks == 3
    # Larger than the bound on its own: its leading 4 blocks, the prefix a continuation hits.
    long = request("c", tokens(300, 26))                             # 28 computed: 7 blocks
    run(sched, runner, long)
    assert list(sched.kv.pins._pins) == ["c"] and sched.stats().num_pinned_blocks == 4
    flush(sched, runner)
    assert hit(sched, runner, request("c2", long.all_token_ids + [1], pin=None)) == 16
    # No bound, no pins.
    none = make_scheduler(16, fraction=0.0)
    run(none, runner, request("a", tokens(100, 10)))
    assert_all_free(none)


def test_a_continuation_pins_the_shared_prefix_once():
    sched = make_scheduler(32)
    runner = FakeRunner()
    first = request("first", tokens(100, 10))
    run(sched, runner, first)
    second = request("second", first.all_token_ids + tokens(500, 6))
    run(sched, runner, second)
    assert second.num_cached_tokens == 12
    # 19 + 3 tokens, 21 computed: 5 blocks, the first 3 of them first's.
    assert sched.stats().num_pinned_blocks == 5
    sched.unpin_kv(["first"])
    assert sched.stats().num_pinned_blocks == 5
    flush(sched, runner)
    assert hit(sched, runner, request("third", second.all_token_ids + [1], pin=None)) == 20
    sched.unpin_kv(["second"])
    assert_all_free(sched)


def test_reset_prefix_cache_drops_pins():
    sched = make_scheduler(16)
    runner = FakeRunner()
    run(sched, runner, request("a", tokens(100, 10)))
    assert sched.reset_prefix_cache()
    assert len(sched.kv.pins) == 0 and sched.kv.block_pool.cached_blocks == {}
    assert_all_free(sched)


def test_pins_keep_a_sliding_window_model_continuation():
    # A full-attention group and a sliding one (window 6): the pin holds every full block
    # and the sliding group's blocks of the last window, all a continuation's hit needs.
    windows = (6, None)
    sched = make_scheduler(40, windows=windows)
    groups = tuple(g.sliding_window for g in sched.kv.layout.groups)
    runner = FakeRunner(windows=groups, null_block_id=sched.kv.block_pool.null_block.block_id)
    first = request("a", tokens(100, 22))
    run(sched, runner, first)
    assert sched.stats().num_pinned_blocks > 0
    flush(sched, runner)
    assert hit(sched, runner, request("a2", first.all_token_ids + [1], pin=None)) == 24
    sched.unpin_kv(["a"])
    assert_all_free(sched)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layout", [(), (6, None, 6)])
def test_randomized_pins_with_continuations(seed: int, layout: tuple):
    """Random traffic where half the requests pin and many continue a pinned one, with
    unpins and expiries: the oracle checks every read; pins hold no block that is free,
    stay under the bound, and leave nothing behind once cleared."""
    rng = random.Random(seed)
    sched = make_scheduler(24 if not layout else 48, fraction=0.5, budget=24, windows=layout,
                           max_model_len=64)
    null = sched.kv.block_pool.null_block
    groups = (tuple(g.sliding_window for g in sched.kv.layout.groups) if layout else (None,))
    runner = FakeRunner(lambda req: rng.choice([EOS] + [5] * 10 + [6] * 10), max_steps=5000,
                        windows=groups, null_block_id=None if null is None else null.block_id)
    live: dict[str, Request] = {}
    done: list[Request] = []
    next_id = 0
    for step_no in range(3000):
        if step_no < 300 and rng.random() < 0.3:
            prompt = [rng.randint(10, 14) for _ in range(rng.randint(1, 20))]
            if done and rng.random() < 0.5:
                prompt = rng.choice(done).all_token_ids[:40] + prompt[:4]
            req = request(f"r{next_id}", prompt[:48], max_tokens=rng.randint(1, 10),
                          pin=rng.choice([None, TTL]), max_model_len=64)
            next_id += 1
            live[req.request_id] = req
            sched.add_request(req)
        if done and rng.random() < 0.05:
            sched.unpin_kv([rng.choice(done).request_id])
        if rng.random() < 0.02:
            sched.kv.pins.expire(float("inf"))
        out = sched.schedule()
        check_step(sched, out)
        for o in sched.update_from_output(out, runner.execute(out)):
            if o.finished:
                done.append(live.pop(o.request_id))
        pool = sched.kv.block_pool
        pool.check_invariants()
        assert sched.kv.pins.num_pinned_blocks <= sched.kv.pins.max_blocks
        assert all(b.ref_cnt > 0 for b in sched.kv.pins._holders)
        if step_no >= 300 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert sched.kv.stats.hits > 0
    sched.kv.pins.clear()
    assert_all_free(sched)
