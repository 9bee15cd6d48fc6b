"""Sleep mode on the CPU (the default model): level 1 frees the KV cache (the weights are host
memory already) and level 2 the whole worker, the process's resident memory drops, and after
wake_up the engine answers exactly as before; sleeping is refused while requests run or
without enable_sleep_mode; requests sent while asleep wait for wake_up."""
from __future__ import annotations

import pytest

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def llm():
    from folio import LLM
    return LLM(max_model_len=256, kv_cache_memory_bytes=1 << 30, enable_sleep_mode=True,
               distributed_executor_backend="uni")


def _answer(llm) -> list[int]:
    from folio import SamplingParams
    out = llm.generate("The capital of France is", SamplingParams(**GREEDY), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_up_answers_the_same(llm, level):
    import weakref
    before = _answer(llm)
    executor = llm.llm_engine.engine_core.executor
    # Every page of the cache resident, as a long-running server's would be (a fresh
    # cache's untouched pages cost no memory yet).
    for cache in executor.worker.kv_caches:
        cache.fill_(0)
    cache_ref = weakref.ref(executor.worker.kv_caches[0])
    rss = _rss()
    freed = llm.sleep(level=level)
    try:
        assert freed["kv_cache"] >= 1 << 29          # the 1 GiB cache (less a rounding)
        assert llm.llm_engine.is_sleeping() and cache_ref() is None
        # the pages go back to the system (level 2: the weights' too); not all of them
        # where the allocator keeps some, as after a long test session
        dropped = rss - _rss()
        assert dropped >= freed["kv_cache"] * 0.5, (dropped, freed)
        if level == 2:
            assert executor.worker is None and freed["weights"] > 50 << 20   # packed weights
        with pytest.raises(ValueError, match="asleep"):
            _answer(llm)                 # offline, nobody else could wake it: refused
    finally:
        llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    assert _answer(llm) == before


def test_sleep_refused_when_busy_or_not_enabled(llm):
    from folio import LLM, SamplingParams
    engine = llm.llm_engine
    engine.add_request("busy", "hello", SamplingParams(**GREEDY))
    with pytest.raises(ValueError, match="in flight"):
        llm.sleep()
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    plain = LLM(max_model_len=128, kv_cache_memory_bytes=1 << 24,
                distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep()


def test_requests_sent_while_asleep_wait_for_wake_up(llm):
    from folio import SamplingParams
    before = _answer(llm)
    engine = llm.llm_engine
    llm.sleep(level=1)
    engine.add_request("waits", "The capital of France is", SamplingParams(**GREEDY))
    for _ in range(5):
        assert engine.step() == []           # nothing runs while asleep
    llm.wake_up(tags=["weights"])            # in part: still asleep
    assert engine.is_sleeping() and engine.step() == []
    llm.wake_up(tags=["kv_cache"])
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert list(done[0].outputs[0].token_ids) == before
