"""The mp executor (`distributed_executor_backend="mp"`): the worker in its own process, fed
the step messages over ZMQ. With one worker every output must equal the in-process
executor's — greedy and seeded tokens, logprobs, penalties counting the token in flight under
async scheduling, preemption in a tight cache, a grammar (its bitmask is the second message of
a step) — and with two workers (two replicas, rank 0 answering) too. A worker that dies is an
error, not a hang. The whole engine, server and structured-output suites also run this way:
`pytest --executor-backend mp tests/engine tests/entrypoints tests/structured_output`."""
from __future__ import annotations

import os
import sys

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path
from folio.sampling_params import StructuredOutputsParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine"))
from test_invariants import _prompts  # noqa: E402


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
            SamplingParams(temperature=0.9, max_tokens=10, seed=5),
            SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3,
                           frequency_penalty=0.5, min_tokens=6),
            SamplingParams(temperature=0, max_tokens=10, bad_words=["the", "The"]),
            SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"]}))]


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        logprobs = None if comp.logprobs is None else [
            {t: round(lp.logprob, 4) for t, lp in row.items()} for row in comp.logprobs]
        prompt_logprobs = None if out.prompt_logprobs is None else [
            None if row is None else {t: round(lp.logprob, 4) for t, lp in row.items()}
            for row in out.prompt_logprobs]
        result.append((comp.token_ids, comp.finish_reason, logprobs, prompt_logprobs))
    return result


def _assert_close(got, expected) -> None:
    for (tokens, reason, lps, plps), (e_tokens, e_reason, e_lps, e_plps) in zip(got, expected):
        assert (tokens, reason) == (e_tokens, e_reason)
        for rows, e_rows in ((lps, e_lps), (plps, e_plps)):
            assert (rows is None) == (e_rows is None)
            for row, e_row in zip(rows or [], e_rows or []):
                assert (row is None) == (e_row is None)
                if row is not None:
                    common = set(row) & set(e_row)  # near-ties may swap the last top-k entry
                    assert len(common) >= len(row) - 1
                    assert all(abs(row[t] - e_row[t]) < 2e-3 for t in common)


def _make(backend: str, **overrides) -> LLM:
    kwargs = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=20,
                  max_num_seqs=8, async_scheduling=True, distributed_executor_backend=backend)
    kwargs.update(overrides)
    return LLM(default_model_path(), **kwargs)


@pytest.fixture(scope="module")
def workload():
    prompts = _prompts(12, seed=3)
    params = [_params()[i % 6] for i in range(12)]
    return prompts, params


@pytest.fixture(scope="module")
def expected(workload):
    llm = _make("uni")
    try:
        return _run(llm, *workload)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("num_workers", [1, 2])
def test_mp_outputs_equal_in_process(workload, expected, num_workers):
    llm = _make("mp", num_workers=num_workers)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert type(executor).__name__ == "MultiprocExecutor"
        assert executor.num_workers == num_workers
        got = _run(llm, *workload)
        if num_workers == 1:
            assert got == expected
        else:
            # Each replica runs torch on its share of the cores (one thread here, two in
            # process): the same tokens, logprobs equal up to summation order.
            _assert_close(got, expected)
        # The tight cache (20 blocks of 16 for 8 running requests) preempted: resumed requests'
        # diffs crossed the boundary too.
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    assert all(proc.exit_reason() is not None for proc in executor._procs_started)


def test_a_dead_worker_is_an_error_not_a_hang():
    from folio.executor.multiproc import WorkerFailed
    llm = _make("mp", num_workers=2)
    try:
        executor = llm.llm_engine.engine_core.executor
        victim = executor._procs_started[1].proc
        victim.kill()
        victim.wait()
        with pytest.raises(WorkerFailed, match="worker 1"):
            llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
