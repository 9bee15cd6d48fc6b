"""Speculative decoding (n-gram) through the engine on the default model (SmolLM2-135M, float32
on the CPU): greedy outputs equal the engine without speculation, token for token, on editing
prompts (a file the answer repeats, where n-gram drafts are accepted) and plain ones; in the
same batch, requests with logprobs, penalties, a logit bias, bad words, min_tokens, allowed ids
or a grammar speculate (each draft position processed and masked with the drafts before it in
its history);
preemption and the prefix cache; seeded sampling gives the same tokens; n > 1; the suffix
method."""
from __future__ import annotations

import json
import os

import pytest

from folio import LLM, SamplingParams
from folio.model.default_model import default_model_path
from folio.sampling_params import StructuredOutputsParams

from test_invariants import _prompts

# A fixed draft length: the acceptance counts these tests assert must not depend on step
# times (the adaptive choice may rightly stop drafting on a loaded machine); one test below
# runs the adaptive policy and asserts only the outputs.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "adaptive_draft_length": False}


def _source(name: str, chars: int = 700) -> str:
    """A piece of a Python standard-library file (text no one here wrote)."""
    path = os.path.join(os.path.dirname(os.__file__), name)
    with open(path, encoding="utf-8") as f:
        return f.read()[:chars]


def _editing_prompts() -> list[str]:
    return [f"Copy this code exactly, changing nothing:\n\n{_source(name)}\n\nCopy:\n"
            for name in ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py")]


def _make(spec: dict | None, **overrides) -> LLM:
    # a float32 cache: logprobs of verified and of one-token steps compared to 1e-3
    kwargs = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=1024,
                  num_gpu_blocks_override=512,
                  max_num_seqs=16, device="cpu", speculative_config=spec)
    kwargs.update(overrides)
    return LLM(default_model_path(), **kwargs)


@pytest.fixture(scope="module")
def plain_llm() -> LLM:
    return _make(None)


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return _make(SPEC)


def _spec_stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.stats()


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_outputs_equal_the_engine_without_speculation(plain_llm, spec_llm) -> None:
    prompts = _editing_prompts() + _prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    before = _spec_stats(spec_llm)
    want = _ids(plain_llm.generate(prompts, params, use_tqdm=False))
    got = _ids(spec_llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    after = _spec_stats(spec_llm)
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    # the editing answers copy their prompt: drafts are made and most are kept
    assert drafts > 10 and accepted > drafts, (drafts, accepted)
    assert sum(after.spec_accepted_per_pos) == after.spec_num_accepted_tokens
    # the offline metrics (vLLM's LLM.get_metrics) tell the same counts
    from folio.metrics.reader import Counter, Vector
    metrics = {m.name: m for m in spec_llm.get_metrics()}
    assert isinstance(metrics["folio:spec_decode_num_drafts"], Counter)
    assert metrics["folio:spec_decode_num_drafts"].value == after.spec_num_drafts
    assert metrics["folio:spec_decode_num_draft_tokens"].value == after.spec_num_draft_tokens
    assert metrics["folio:spec_decode_num_accepted_tokens"].value == \
        after.spec_num_accepted_tokens
    per_pos = metrics["folio:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == after.spec_accepted_per_pos
    assert per_pos.labels["engine"] == "0"


def test_requests_with_every_sampling_option_share_the_batch(plain_llm, spec_llm) -> None:
    prompts = _editing_prompts()[:2] * 2 + _prompts(2, seed=4)
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"]}
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[198]),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=10),
              SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.5,
                             presence_penalty=0.3, bad_words=[" return"]),
              # verified with speculation: the bias applies at every draft position
              SamplingParams(temperature=0, max_tokens=24, logit_bias={198: -100.0, 220: 5.0}),
              SamplingParams(temperature=0.7, max_tokens=24, seed=3,
                             allowed_token_ids=list(range(200, 4000)))]
    prompts = prompts + _editing_prompts()[1:4]
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    # logprobs as without speculation, for every token (kept drafts included)
    assert len(got[1].outputs[0].logprobs) == len(got[1].outputs[0].token_ids)
    for a, b in zip(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-3 and a[t].rank == b[t].rank
    json.loads(got[4].outputs[0].text)


def _piece_from(text: str, at: float, length: int = 7) -> str:
    """A piece of an answer that first occurs past the fraction `at` of it: a stop string
    that the copying answers reach after kept drafts."""
    for start in range(int(at * len(text)), len(text) - length):
        piece = text[start:start + length]
        if text.find(piece) == start:
            return piece
    raise AssertionError(f"no piece of {text!r} occurs once past {at}")


def test_stop_strings_end_the_output_where_one_token_a_step_would(plain_llm, spec_llm) -> None:
    """A stop string completed by a kept draft ends the output at that token: the tokens the
    same step kept after it are neither in token_ids nor in the logprobs (they had been), and
    the finish is the stop string's."""
    prompts = _editing_prompts()[:3]   # (the fourth answer loops: no piece occurs once)
    free = plain_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64),
                              use_tqdm=False)
    # several stop strings a prompt, each its own request: the answers copy their prompt, so
    # most steps keep several drafts, and a stop string that completes at the last token of
    # its step would not show the difference
    cases = [(p, _piece_from(o.outputs[0].text, at))
             for p, o in zip(prompts, free) for at in (0.3, 0.42, 0.54, 0.66, 0.78)]
    prompts = [p for p, _ in cases]
    before = _spec_stats(spec_llm)
    cut_short = 0
    for include in (False, True):
        params = [SamplingParams(temperature=0, max_tokens=64, logprobs=1, stop=[s],
                                 include_stop_str_in_output=include) for _, s in cases]
        want = plain_llm.generate(prompts, params, use_tqdm=False)
        got = spec_llm.generate(prompts, params, use_tqdm=False)
        for g, w, (_, s) in zip(got, want, cases):
            g, w = g.outputs[0], w.outputs[0]
            assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason) == \
                (list(w.token_ids), w.text, w.finish_reason, w.stop_reason)
            assert g.stop_reason == s and len(g.logprobs) == len(g.token_ids)
            cut_short += len(g.token_ids) < 64
    after = _spec_stats(spec_llm)
    assert cut_short == 2 * len(cases)
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 50


_RECORDS = [{"name": "Ada Lovelace", "born": 1815, "field": "mathematics"},
            {"name": "Alan Turing", "born": 1912, "field": "computing"},
            {"name": "Grace Hopper", "born": 1906, "field": "compilers"}]
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                            "born": {"type": "integer"},
                                            "field": {"type": "string"}},
           "required": ["name", "born", "field"], "additionalProperties": False}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_grammar_requests_speculate_within_their_grammar(backend: str) -> None:
    """JSON answers that copy a record from the prompt: the n-gram drafts are masked per
    position by the grammar (each draft row after the drafts before it), so drafts are kept,
    the answers equal the engine's without speculation, and they follow the schema."""
    prompts = [f"Copy this JSON record exactly:\n{json.dumps(r)}\nCopy:\n" for r in _RECORDS]
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=_SCHEMA))
    config = {"backend": backend}
    want = _ids(_make(None, structured_outputs_config=config).generate(
        prompts, params, use_tqdm=False))
    llm = _make(SPEC, structured_outputs_config=config)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == want
    for out in outs:
        record = json.loads(out.outputs[0].text)
        assert set(record) == {"name", "born", "field"} and isinstance(record["born"], int)
    stats = _spec_stats(llm)
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_preemption_and_the_prefix_cache(plain_llm) -> None:
    """Few blocks: requests are preempted (their drafts dropped) and recomputed, much of it
    from the prefix cache; the answers are still the engine's without speculation."""
    prompts = _editing_prompts()
    params = SamplingParams(temperature=0, max_tokens=48)
    want = _ids(plain_llm.generate(prompts, params, use_tqdm=False))
    small = _make(SPEC, num_gpu_blocks_override=60, max_model_len=512, max_num_seqs=4)
    got = _ids(small.generate(prompts, params, use_tqdm=False))
    stats = _spec_stats(small)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0
    assert got == want


def test_seeded_sampling_equals_the_engine_without_speculation(plain_llm, spec_llm) -> None:
    """A seeded request draws one noise vector per emitted token from its own generator,
    as without speculation, so its tokens do not depend on how many drafts each step
    verified (which the adaptive draft length decides from measured times)."""
    prompts = _editing_prompts()[:2]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=32)
    want = _ids(plain_llm.generate(prompts, params, use_tqdm=False))
    first = _ids(spec_llm.generate(prompts, params, use_tqdm=False))
    again = _ids(spec_llm.generate(prompts, params, use_tqdm=False))
    assert first == again == want and all(len(ids) == 32 for ids in first)
    out = spec_llm.generate(prompts[0], SamplingParams(temperature=1.0, n=2, max_tokens=16,
                                                       seed=9), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 16 for c in out.outputs)


def test_the_adaptive_draft_length_keeps_the_outputs(plain_llm) -> None:
    """The default policy chooses k per step from measured times; whatever it chooses, the
    tokens are the engine's without speculation."""
    prompts = _editing_prompts()[:2] + _prompts(2, seed=6)
    params = SamplingParams(temperature=0, max_tokens=32)
    adaptive = _make({key: value for key, value in SPEC.items()
                      if key != "adaptive_draft_length"})
    assert _ids(adaptive.generate(prompts, params, use_tqdm=False)) == \
        _ids(plain_llm.generate(prompts, params, use_tqdm=False))


class _Resting:
    """A draft-length policy that never drafts (as the adaptive one at a large batch)."""

    def will_draft(self, drafting, other_tokens) -> bool:
        return False

    def wants_proposals(self, batch_size=None) -> bool:
        return False

    def choose(self, drafting, other_tokens) -> int:
        return 0

    def observe_step(self, num_tokens, seconds, verify) -> None:
        pass

    def observe_acceptance(self, request_id, num_drafts, accepted) -> None:
        pass

    def drop(self, request_id) -> None:
        pass


def test_async_scheduling_runs_beside_speculation(plain_llm) -> None:
    """Asked for together, both run: a step that verifies drafts stays in flight when the
    call that queued it returns, and the next call finishes it before it schedules (the next
    step needs its kept tokens); the others overlap. The answers are the engine's without
    speculation, drafts are kept, and while the policy drafts nothing every step overlaps
    (a step stays in flight as the next is scheduled)."""
    llm = _make(SPEC, async_scheduling=True)
    core = llm.llm_engine.engine_core
    assert core.async_scheduling is True
    prompts = _editing_prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = _ids(plain_llm.generate(prompts, params, use_tqdm=False))
    engine = llm.llm_engine

    def run(prefix: str) -> tuple[list[list[int]], list[bool]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{prefix}-{i}", prompt, params)
        got: dict[str, list[int]] = {}
        verifying, undecided = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            verify = (core._in_flight is not None
                      and bool(core._in_flight[0].message.scheduled_spec_decode_tokens))
            verifying.append(verify)
            if verify:
                # every request drafting, greedy, no logprobs: its kept tokens are decided
                # when the output is taken (a request without drafts is sampled at once)
                message = core._in_flight[0].message
                pending = core._in_flight[1]
                pending = getattr(pending, "_pending", pending)   # the step-message check's
                all_drafting = set(message.sampling_req_ids) <= set(
                    message.scheduled_spec_decode_tokens)
                undecided.append((all_drafting, pending._verify_argmax is not None))
        return [got[f"{prefix}-{i}"] for i in range(len(prompts))], verifying, undecided
    answers, verifying, undecided = run("spec")
    assert answers == want
    assert _spec_stats(llm).spec_num_accepted_tokens > 0
    assert any(verifying)                 # verify steps left in flight as the call returned
    assert any(all_drafting for all_drafting, _ in undecided)
    assert all(all_drafting == deferred for all_drafting, deferred in undecided)
    core.scheduler.draft_length = _Resting()
    got: dict[str, list[int]] = {}
    in_flight = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"rest-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        in_flight.append(core._in_flight is not None)
    assert [got[f"rest-{i}"] for i in range(len(prompts))] == want
    assert sum(in_flight) >= len(in_flight) - 2    # all but the last steps overlapped


def test_suffix_greedy_outputs_equal_and_learn_across_requests(plain_llm) -> None:
    """The suffix method: the same answers; the second round of the same prompts drafts from
    the first round's outputs too (the shared index), so it keeps more drafts."""
    llm = _make({"method": "suffix", "num_speculative_tokens": 6,
                 "adaptive_draft_length": False})
    prompts = _prompts(3, seed=5) + _editing_prompts()[:1]
    params = SamplingParams(temperature=0, max_tokens=32)
    want = _ids(plain_llm.generate(prompts, params, use_tqdm=False))
    first = _ids(llm.generate(prompts, params, use_tqdm=False))
    s1 = _spec_stats(llm)
    llm.reset_prefix_cache()
    second = _ids(llm.generate(prompts, params, use_tqdm=False))
    s2 = _spec_stats(llm)
    assert first == want and second == want
    accepted_first = s1.spec_num_accepted_tokens
    accepted_second = s2.spec_num_accepted_tokens - s1.spec_num_accepted_tokens
    assert accepted_first > 0 and accepted_second > accepted_first


def test_speculation_builds_the_layers_for_few_row_verify_steps(plain_llm, spec_llm) -> None:
    """With speculation the layers' GEMV default covers the verify step's k + 1 rows
    (kernel_config.SPECULATIVE_GEMV), FOLIO_GEMV overriding it as ever."""
    from folio.model.kernel_config import resolve_kernel_config
    from folio.model.layers import Linear

    def gemv_modes(llm: LLM) -> set[str]:
        model = llm.llm_engine.engine_core.executor.worker.model
        return {m.kernels.gemv for m in model.modules() if isinstance(m, Linear)}

    assert gemv_modes(spec_llm) == {resolve_kernel_config(speculative=True).gemv}
    assert gemv_modes(plain_llm) == {resolve_kernel_config().gemv}


def test_disable_by_batch_size_drafts_only_below_the_cap(plain_llm) -> None:
    """vLLM's disable_by_batch_size through the engine, a cap of 3: four editing answers
    decoding together make no drafts at all; with two of them short, the long two draft
    once the short ones have finished. Outputs as without speculation."""
    prompts = _editing_prompts()
    llm = _make({**SPEC, "disable_by_batch_size": 3})
    for lengths in ([40, 40, 40, 40], [8, 8, 40, 40]):
        params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
        before = _spec_stats(llm).spec_num_drafts
        got = _ids(llm.generate(prompts, params, use_tqdm=False))
        assert got == _ids(plain_llm.generate(prompts, params, use_tqdm=False))
        drafts = _spec_stats(llm).spec_num_drafts - before
        assert (drafts > 0) == (lengths[0] == 8), (lengths, drafts)
