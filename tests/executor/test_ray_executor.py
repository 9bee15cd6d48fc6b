"""The Ray executor (issue 22, item 5) on a local Ray cluster of this machine's cores: tensor
or pipeline parallelism over two Ray actors answers as one rank does, and a worker whose actor is killed
ends the engine with a clear error, in bounded time."""
from __future__ import annotations

import random
import time

import pytest

from folio import LLM, SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             object_store_memory=100 << 20)
    yield
    ray.shutdown()


def _prompts(n: int) -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(rng.randint(4, 60))]}
            for _ in range(n)]


def _llm(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 26,
               enable_prefix_caching=True, max_num_batched_tokens=64, **kw)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}])
def test_tp2_and_pp2_on_ray_equal_one_rank(tiny_model_dir, layout):
    model = tiny_model_dir("qwen3")
    prompts = _prompts(15)
    one = _llm(model)
    try:
        expected = _greedy(one, prompts)
    finally:
        one.llm_engine.shutdown()
    llm = _llm(model, distributed_executor_backend="ray", **layout)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor._procs) == 2
        assert _greedy(llm, prompts) == expected
    finally:
        llm.llm_engine.shutdown()
    # the actors are gone with the engine
    assert all(w.exit_reason() is not None for w in executor._procs_started)


def test_a_killed_ray_worker_ends_the_engine_with_a_clear_error(tiny_model_dir):
    from folio.executor.multiproc import WorkerFailed
    llm = _llm(tiny_model_dir("llama"), tensor_parallel_size=2,
               distributed_executor_backend="ray")
    try:
        executor = llm.llm_engine.engine_core.executor
        _greedy(llm, _prompts(2))
        ray.kill(executor._procs_started[1].actor)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"worker \d"):
            for _ in range(50):   # the failure shows within a step or two
                _greedy(llm, _prompts(2))
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        llm.llm_engine.shutdown()
        assert time.monotonic() - start < 30
