"""Async scheduling: step N+1 is scheduled and queued before step N's sampled ids reach the
host (the pending token feeds N+1 on the device). On the CPU there is nothing to overlap, but
the bookkeeping is the same, so it is forced on here and every output must equal the
synchronous engine's: greedy and seeded tokens, stops, preemption (incl. a request preempted
with its token in flight), chunked prefill, logprobs, penalties and min_tokens (which count
the token still on the device), and the requests that wait for their token (bad words,
grammars). The CUDA-graph path is covered by
tests/gpu/test_gpu_engine.py."""
from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path

from test_invariants import _prompts


@pytest.fixture(scope="module")
def model_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return _prompts(32, seed=1)


def _make(model_dir: str, async_scheduling: bool, **overrides) -> LLM:
    kwargs = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
                  max_num_seqs=32, async_scheduling=async_scheduling)
    kwargs.update(overrides)
    return LLM(model_dir, **kwargs)


@pytest.fixture(scope="module")
def sync_llm(model_dir) -> LLM:
    return _make(model_dir, False)


@pytest.fixture(scope="module")
def async_llm(model_dir) -> LLM:
    return _make(model_dir, True)


def _mixed_params() -> list[SamplingParams]:
    """Natural stops (EOS on), stop tokens, different lengths, greedy and seeded."""
    params = []
    for i in range(32):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=3 + i % 7))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=i))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[13, 30]))
        else:
            params.append(SamplingParams(temperature=1.0, top_k=20, max_tokens=9, seed=100 + i,
                                         ignore_eos=True))
    return params


def _run(llm: LLM, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_really_runs_ahead(async_llm, prompts):
    """The second step is queued before the first one's token is read: its decode row takes
    that token from the device, and step() hands back tokens one call late."""
    engine = async_llm.llm_engine
    core = engine.engine_core
    assert core.async_scheduling
    engine.add_request("ahead", prompts[0], SamplingParams(temperature=0, max_tokens=4))
    assert core.step() == []          # the prefill is queued, nothing is back yet
    scheduler_output, _ = core._in_flight
    assert [s.request_id for s in scheduler_output.scheduled] == ["ahead"]
    first = core.step()               # the decode is queued, the prefill's token comes back
    assert [o.request_id for o in first] == ["ahead"] and len(first[0].new_token_ids) == 1
    decode, _ = core._in_flight
    assert decode.scheduled[0].num_new_tokens == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert core._in_flight is None


def test_mixed_batch_same_as_sync(sync_llm, async_llm, prompts):
    params = _mixed_params()
    expected = _run(sync_llm, prompts, params)
    assert _run(async_llm, prompts, params) == expected
    # Some stopped early (EOS or stop tokens), some ran to their length.
    reasons = {reason for _, reason in expected}
    assert "length" in reasons and "stop" in reasons


def test_preemption_same_as_sync(model_dir, sync_llm, prompts):
    params = [SamplingParams(temperature=1.0, max_tokens=14, seed=i, ignore_eos=True)
              for i in range(32)]
    expected = _run(sync_llm, prompts, params)
    tight = _make(model_dir, True, num_gpu_blocks_override=24, max_model_len=256)
    assert _run(tight, prompts, params) == expected
    core = tight.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    pool = core.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_chunked_prefill_same_as_sync(model_dir, sync_llm, prompts):
    params = _mixed_params()
    expected = _run(sync_llm, prompts, params)
    chunked = _make(model_dir, True, max_num_batched_tokens=24)
    assert _run(chunked, prompts, params) == expected


def test_logprobs_same_as_sync(sync_llm, async_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    a = sync_llm.generate(prompts[:4], params, use_tqdm=False)
    b = async_llm.generate(prompts[:4], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            for t in lx:
                assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-5)
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs)


def test_penalties_and_min_tokens_count_the_token_in_flight(sync_llm, async_llm, prompts):
    """Penalties and min_tokens run ahead: the sampler adds the latest token, still on the
    device, to the counts it builds from the host lists. Bad words need the token's value on
    the host, so the engine finishes the step in flight first. Tokens match the sync engine."""
    params = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=10, frequency_penalty=0.8,
                             presence_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=8),
              SamplingParams(temperature=0, max_tokens=10, bad_words=["the", "The"]),
              SamplingParams(temperature=0.9, max_tokens=10, seed=3, repetition_penalty=1.2,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10)]
    expected = _run(sync_llm, prompts[:6], params)
    assert _run(async_llm, prompts[:6], params) == expected
    # Penalties change greedy output here, so the check can fail when they are dropped (or
    # when the token in flight is not counted: the sync engine counts it).
    plain = _run(sync_llm, prompts[:2], [SamplingParams(temperature=0, max_tokens=10)] * 2)
    assert plain != expected[:2]

    # Whether a step was scheduled with its input still on the device, seen when scheduled.
    engine = async_llm.llm_engine
    scheduler = engine.engine_core.scheduler
    launched: list[bool] = []
    inner = scheduler.schedule

    def record():
        step = inner()
        if not step.is_empty:
            launched.append(any(s.has_pending_input for s in step.scheduled))
        return step

    scheduler.schedule = record
    try:
        for rid, p in (("penalised", params[0]), ("min-tokens", params[2]),
                       ("bad-words", params[3])):
            launched.clear()
            engine.add_request(rid, prompts[0], SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=p.repetition_penalty,
                min_tokens=p.min_tokens, bad_words=p.bad_words))
            while engine.has_unfinished_requests():
                engine.step()
            # Seven decode steps after the prefill: all ahead, or (bad words) none.
            assert launched == [False] + [rid != "bad-words"] * 7, (rid, launched)
    finally:
        del scheduler.schedule


def test_grammar_requests_same_as_sync(sync_llm, async_llm, prompts):
    from folio.sampling_params import StructuredOutputsParams
    params = [SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{3}")),
              SamplingParams(temperature=0, max_tokens=12)]
    expected = _run(sync_llm, prompts[:2], params)
    got = _run(async_llm, prompts[:2], params)
    assert got == expected
    text = async_llm.get_tokenizer().decode(got[0][0], skip_special_tokens=True)
    assert len(text) == 6 and text[2] == "-"


def test_abort_while_in_flight(async_llm, prompts):
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("keep", prompts[1], params)
    engine.add_request("drop", prompts[2], params)
    engine.step()
    engine.step()
    engine.abort_request("drop")       # its next step is already queued
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert "drop" not in outputs or not outputs["drop"].finished or \
        outputs["drop"].outputs[0].finish_reason == "abort"
    assert outputs["keep"].finished
    alone = async_llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert outputs["keep"].outputs[0].token_ids == alone.outputs[0].token_ids
    pool = async_llm.llm_engine.engine_core.kv_cache_manager.block_pool
    pool.check_invariants()


def test_worker_state_of_finished_requests_is_dropped(model_dir, prompts):
    """Per-request worker state (token lists, rows, sampling states, seeded generators) goes
    when the request does, also when its finish is noticed in a step that schedules nothing
    new. In process: the test reads the worker's batch (also under --executor-backend mp)."""
    async_llm = _make(model_dir, True, distributed_executor_backend="uni")
    params = [SamplingParams(temperature=1.0, max_tokens=3 + i, seed=i) for i in range(6)]
    async_llm.generate(prompts[:6], params, use_tqdm=False)
    engine = async_llm.llm_engine
    while engine.has_unfinished_requests() or engine.engine_core.has_pending_notifications():
        engine.step()
    engine.engine_core.step()  # an idle step hands the last finishes to the worker
    runner = engine.engine_core.executor.worker.runner
    assert runner.input_batch.requests == {}
    assert len(runner.input_batch._free_rows) == runner.input_batch.max_num_reqs
