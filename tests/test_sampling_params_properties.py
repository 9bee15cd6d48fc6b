"""Property-based tests (hypothesis) of SamplingParams' contract, end to end offline.

Every combination of keyword arguments, valid or not, either
  * is refused by `SamplingParams(**kw)` with a ValueError whose message starts with the name
    of a field the caller set (to a non-default value), or
  * is refused by `LLM.generate` (request limits, vocabulary, KV-cache fit) with a ValueError
    whose message starts with the name of a set field or "prompt", leaving the engine usable,
  * or is served: a finished RequestOutput with n completions, each finished by "stop" or
    "length" and no longer than max_tokens (or the room the prompt leaves).
Any other exception type (TypeError, OverflowError...) is a bug: on the server it is a 500.

A tiny random Llama (vocab 49,152) with a short context keeps each generation cheap.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from folio import LLM, SamplingParams
from folio.request_outputs import RequestOutput
from folio.sampling_params import RequestOutputKind
from folio.structured_output.params import StructuredOutputsParams

import model_utils

VOCAB = model_utils.TINY_VOCAB
MAX_MODEL_LEN = 128
NUM_BLOCKS = 64  # x 16 = 1,024 tokens of KV cache

FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams) if f.init}
DEFAULTS = {name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for name, f in FIELDS.items()}
# Prompt-side names an engine error may start with (the prompt is not a SamplingParams field).
PROMPT_NAMES = {"prompt", "prompt_token_ids"}
_LEADING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Prompts: short ones, and one that leaves exactly 8 tokens of room, used whenever max_tokens
# is unbounded (None or huge) so that the clamped generation stays short.
SHORT_PROMPTS = ["Hello", "The capital of France is", {"prompt_token_ids": [1, 2, 3, 4]},
                 [17, 300, 4000]]
LONG_PROMPT = {"prompt_token_ids": [100 + i for i in range(MAX_MODEL_LEN - 8)]}
MAX_VALID_TOKENS = 8
# Prompts the engine refuses (empty, too long, ids outside the vocabulary, wrong types).
BAD_PROMPTS = ["", {"prompt_token_ids": []}, {"prompt_token_ids": list(range(200))},
               {"prompt_token_ids": list(range(MAX_MODEL_LEN))}, "word " * 200,
               {"prompt_token_ids": [1, VOCAB]}, [5, -1], {"prompt_token_ids": "abc"},
               {"text": "no prompt key"}, 12345, None]


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

def _small_text(min_size: int = 1) -> st.SearchStrategy[str]:
    return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                   min_size=min_size, max_size=6)


_token_id = st.integers(0, VOCAB - 1)
_finite = dict(allow_nan=False, allow_infinity=False)

# Values SamplingParams accepts and this engine serves (cross-field rules are fixed up in
# `sampling_kwargs`). max_tokens' unbounded values are served against the long prompt.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 3),
    "presence_penalty": st.floats(-2.0, 2.0, **_finite),
    "frequency_penalty": st.floats(-2.0, 2.0, **_finite),
    "repetition_penalty": st.floats(0.05, 5.0) | st.sampled_from([1.0, 1e-9, 1e6]),
    "temperature": st.sampled_from([0.0, 1e-6, 0.7, 1.0, 1e300]) | st.floats(0.0, 3.0),
    "top_p": st.floats(0.0, 1.0, exclude_min=True) | st.just(1),
    "top_k": st.sampled_from([0, -1, 1, 2, 50, VOCAB - 1, VOCAB, 10**6]),
    "min_p": st.floats(0.0, 1.0) | st.just(0),
    "seed": st.none() | st.sampled_from([0, -1, 2**63 - 1, -(2**63)]) | st.integers(-10**6, 10**6),
    "stop": st.none() | _small_text() | st.lists(_small_text(), max_size=3) | st.just(("x", "y")),
    "stop_token_ids": st.none() | st.lists(_token_id, max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": st.integers(1, MAX_VALID_TOKENS) | st.sampled_from([None, 10**6, 2**62]),
    "min_tokens": st.integers(0, MAX_VALID_TOKENS),
    "logprobs": st.none() | st.integers(0, 20),
    "prompt_logprobs": st.none() | st.integers(0, 5),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.none() | st.dictionaries(
        _token_id | _token_id.map(str) | _token_id.map(lambda t: f" {t} "),
        st.floats(-100.0, 100.0) | st.integers(-100, 100), max_size=4),
    "allowed_token_ids": st.none() | st.lists(_token_id, min_size=1, max_size=6),
    "bad_words": st.none() | st.lists(_small_text(), max_size=3),
    "truncate_prompt_tokens": st.none() | st.sampled_from([-1, 1, 3, 500, 10**9]),
    "structured_outputs": st.none() | st.sampled_from([
        StructuredOutputsParams(regex="[a-z]{1,8}"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(json={"type": "object"}),
    ]),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
}

_HUGE_INTS = [2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 2**200, 10**400, 10**5000,
              -(10**5000)]
_WRONG_TYPES = st.sampled_from([None, True, False, "1", b"1", 1.5, [1], {"a": 1}, object(),
                                float("nan")])
_BAD_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 10**400, -(10**400),
                               "0.5", None, True, [0.5]])

# Values the constructor must refuse: a wrong type, or out of range.
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.sampled_from([0, -1, *_HUGE_INTS]) | _WRONG_TYPES,
    "presence_penalty": st.sampled_from([2.01, -2.5, 1e300]) | _BAD_FLOATS,
    "frequency_penalty": st.sampled_from([2.5, -2.01, -1e300]) | _BAD_FLOATS,
    "repetition_penalty": st.sampled_from([0.0, -1.0, -1e-300]) | _BAD_FLOATS,
    "temperature": st.sampled_from([-1e-9, -1.0, -1e300]) | _BAD_FLOATS,
    "top_p": st.sampled_from([0.0, -0.1, 1.0000001, 2, 1e300]) | _BAD_FLOATS,
    "top_k": st.sampled_from([-2, -5, -(10**30), *_HUGE_INTS]) | _WRONG_TYPES,
    "min_p": st.sampled_from([-0.01, 1.01, 1e300]) | _BAD_FLOATS,
    "seed": st.sampled_from(_HUGE_INTS) | st.sampled_from(["7", 1.5, True, [1]]),
    "stop": st.sampled_from(["", [""], ["a", ""], [1], ["a", None], 5, b"x", {"a": 1}]),
    "stop_token_ids": st.sampled_from([[-1], [True], [1.5], ["3"], "123", 5, [2**64],
                                       [10**5000]]),
    "ignore_eos": _WRONG_TYPES.filter(lambda v: not isinstance(v, bool)),
    "max_tokens": st.sampled_from([0, -1, -(2**64), "8", 8.0, True, [8], *_HUGE_INTS]),
    "min_tokens": st.sampled_from([-1, MAX_VALID_TOKENS + 1, 10**6, 2**64, None, "1", 1.0,
                                   True]),
    "logprobs": st.sampled_from([-2, -(10**6), 2**64, "1", 1.0, True]),
    "prompt_logprobs": st.sampled_from([-2, -(10**6), 2**64, "1", 1.0, True]),
    "detokenize": _WRONG_TYPES.filter(lambda v: not isinstance(v, bool)),
    "skip_special_tokens": _WRONG_TYPES.filter(lambda v: not isinstance(v, bool)),
    "spaces_between_special_tokens": _WRONG_TYPES.filter(lambda v: not isinstance(v, bool)),
    "include_stop_str_in_output": _WRONG_TYPES.filter(lambda v: not isinstance(v, bool)),
    "logit_bias": st.sampled_from([
        {1: 100.5}, {1: -101}, {1: float("nan")}, {1: float("inf")}, {1: 10**400},
        {1: 10**5000}, {1: "x"}, {1: None}, {"abc": 1.0}, {"": 1.0}, {"1.5": 1.0},
        {1.5: 1.0}, {True: 1.0}, {None: 1.0}, {(1,): 1.0}, {-1: 1.0}, {"-3": 1.0},
        {2**64: 1.0}, {10**5000: 1.0}, {"9" * 30: 1.0}, {"9" * 5000: 1.0}, [1, 2], "1:2", 5]),
    "allowed_token_ids": st.sampled_from([[], [-1], [True], [1.5], "12", 5, [2**64],
                                          [-(10**5000)]]),
    "bad_words": st.sampled_from(["", [""], [1], 5, {"a": 1}]),
    "truncate_prompt_tokens": st.sampled_from([0, -2, -(10**9), "5", 5.0, True, 2**64]),
    "structured_outputs": st.sampled_from([
        "json", {"regex": "a+"}, 5,
        StructuredOutputsParams(),  # no constraint at all
        StructuredOutputsParams(regex="a+", choice=["a"]),  # two at once
    ]),
    "output_kind": st.sampled_from([0, "delta", None, "FINAL_ONLY"]),
}

# Values the constructor accepts and the engine refuses: beyond a request limit, outside the
# vocabulary, too much KV cache, or a constraint no grammar backend compiles.
ENGINE_INVALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.sampled_from([129, 10**6, 100]),  # 100 x (prompt + max_tokens) > 1,024
    "logprobs": st.sampled_from([-1, 21, 10**6]),
    "prompt_logprobs": st.sampled_from([-1, 21, 10**6]),
    "stop": st.sampled_from([["x"] * 65, ["x" * 513], [str(i) for i in range(200)]]),
    "stop_token_ids": st.sampled_from([[VOCAB], [10**9], [2**62], list(range(4097))]),
    "logit_bias": st.sampled_from([{VOCAB: 1.0}, {str(VOCAB): 0.0}, {10**9: 1.0}, {2**62: 1},
                                   {i: 0.0 for i in range(1025)}]),
    "allowed_token_ids": st.sampled_from([[VOCAB], [10**9], list(range(4097))]),
    "bad_words": st.sampled_from([["w"] * 257, ["w" * 513]]),
    "structured_outputs": st.sampled_from([
        StructuredOutputsParams(regex="("),
        StructuredOutputsParams(choice=[]),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(json={"type": "no-such-type"}),
        StructuredOutputsParams(grammar="root ::= "),
        StructuredOutputsParams(regex="a" * (1 << 20 + 1)),  # over --max-schema-bytes
    ]),
}

assert set(VALID) == set(FIELDS) == set(INVALID), set(FIELDS) ^ set(VALID) ^ set(INVALID)
assert set(ENGINE_INVALID) <= set(FIELDS)


def _show(value: Any) -> str:
    """repr(), except that ints too long for str() (over 4,300 digits) show their size."""
    if type(value) is int and value.bit_length() > 1000:
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_show(k)}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> tuple[dict[str, Any], Any, set[str]]:
    """(kwargs, prompt, names of the fields given an invalid value). Valid values first, with
    their cross-field rules respected; then 0-2 fields replaced by values the constructor
    refuses and 0-1 by a value the engine refuses."""
    names = sorted(FIELDS)
    # Each field given (a valid value) with probability ~1/3.
    chosen = {name for name in names if draw(st.integers(0, 2), label=f"give {name}") == 0}
    kw = {name: draw(VALID[name], label=name) for name in sorted(chosen | {"max_tokens"})}
    # Cross-field rules of valid requests (max_tokens is always given: never the default 16).
    if kw.get("n", 1) > 1 and kw.get("temperature", 1.0) < 1e-5:
        kw["n"] = 1  # n > 1 needs random sampling
    max_tokens = kw["max_tokens"]
    if max_tokens is not None and kw.get("min_tokens", 0) > max_tokens:
        kw["min_tokens"] = max_tokens
    if not kw.get("detokenize", True) and kw.get("stop"):
        kw["detokenize"] = True  # stop strings are matched in the text
    # About half the examples stay valid; the others get 1-2 values the constructor refuses
    # and/or one the engine refuses.
    num_invalid = draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2]), label="how many invalid")
    invalid = set(draw(st.lists(st.sampled_from(names), min_size=num_invalid,
                                max_size=num_invalid), label="invalid fields"))
    for name in sorted(invalid):
        kw[name] = draw(INVALID[name], label=f"invalid {name}")
    if draw(st.integers(0, 4), label="engine-invalid?") == 0:
        name = draw(st.sampled_from(sorted(ENGINE_INVALID)), label="engine-invalid field")
        kw[name] = draw(ENGINE_INVALID[name], label=f"engine-invalid {name}")
        invalid.add(name)
    max_tokens = kw["max_tokens"]
    if max_tokens is None or (type(max_tokens) is int and max_tokens > MAX_VALID_TOKENS):
        # Unbounded: served against the long prompt (8 tokens of room), which truncation
        # must keep whole.
        if kw.get("truncate_prompt_tokens") not in (None, -1) and "truncate_prompt_tokens" \
                not in invalid:
            kw["truncate_prompt_tokens"] = 10**9
        prompt = LONG_PROMPT
    else:
        prompt = draw(st.sampled_from(SHORT_PROMPTS), label="prompt")
    if draw(st.integers(0, 9), label="bad prompt?") == 0:
        prompt = draw(st.sampled_from(BAD_PROMPTS), label="bad prompt")
        invalid.add("prompt")
    return kw, prompt, invalid


def _is_default(name: str, value: Any) -> bool:
    default = DEFAULTS[name]
    return type(value) is type(default) and value == default


def _leading_name(message: str) -> str | None:
    match = _LEADING_NAME.match(message)
    return match.group(0) if match else None


def _assert_names_a_set_field(exc: ValueError, kw: dict[str, Any], extra: set[str] = set()) -> None:
    message = str(exc)
    name = _leading_name(message)
    set_fields = {k for k, v in kw.items() if not _is_default(k, v)}
    assert name in FIELDS.keys() | extra, f"message does not start with a field name: {message!r}"
    assert name in set_fields | extra, (
        f"message names {name!r}, which the caller did not set (set: {sorted(set_fields)}): "
        f"{message!r}")


# ---------------------------------------------------------------------------------------
# The offline engine
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    # One intra-op thread: tiny matmuls gain nothing from threads on a busy machine.
    with model_utils.torch_threads(1):
        yield LLM(tiny_model_dir("llama"), max_model_len=MAX_MODEL_LEN,
                  num_gpu_blocks_override=NUM_BLOCKS, dtype="float32")


def _prompt_len(llm: LLM, prompt: Any) -> int:
    if isinstance(prompt, dict):
        return len(prompt["prompt_token_ids"])
    if isinstance(prompt, list):
        return len(prompt)
    return len(llm.get_tokenizer().encode(prompt))


def _check_output(llm: LLM, out: RequestOutput, params: SamplingParams, prompt: Any) -> None:
    assert isinstance(out, RequestOutput) and out.finished
    prompt_len = _prompt_len(llm, prompt)
    if params.truncate_prompt_tokens is not None:
        truncate = params.truncate_prompt_tokens
        keep = MAX_MODEL_LEN if truncate == -1 else truncate
        prompt_len = min(prompt_len, keep)
    assert len(out.prompt_token_ids) == prompt_len
    room = MAX_MODEL_LEN - prompt_len
    limit = room if params.max_tokens is None else min(params.max_tokens, room)
    assert sorted(c.index for c in out.outputs) == list(range(params.n))
    if params.prompt_logprobs is not None:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == prompt_len
    for c in out.outputs:
        note(f"completion {c.index}: {len(c.token_ids)} tokens, {c.finish_reason}, "
             f"stop_reason={c.stop_reason!r}")
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        assert 1 <= len(c.token_ids) <= limit
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in c.token_ids)
        assert isinstance(c.text, str)
        if c.finish_reason == "length":
            assert len(c.token_ids) == limit
        elif not isinstance(c.stop_reason, str):
            # EOS or a stop token: not before min_tokens.
            assert len(c.token_ids) >= min(params.min_tokens, limit)
        if params.allowed_token_ids is not None and not (
                params.structured_outputs or params.bad_words or params.min_tokens):
            # Only when nothing else masks tokens: together, masks can leave no token at all
            # (the sampler then emits id 0; an unsatisfiable request, not checked here).
            assert set(c.token_ids) <= set(params.allowed_token_ids)
        if params.logprobs is not None:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for tid, position in zip(c.token_ids, c.logprobs):
                assert tid in position
                assert all(not math.isnan(lp.logprob) for lp in position.values())


def _assert_engine_idle(llm: LLM) -> None:
    """Nothing queued, and every KV block back in the pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.engine_core.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def _still_serves(llm: LLM) -> None:
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    _assert_engine_idle(llm)


_outcomes: dict[str, int] = {}


def _outcome(name: str) -> None:
    event(name)
    _outcomes[name] = _outcomes.get(name, 0) + 1


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(case=sampling_kwargs())
def test_every_combination_is_refused_by_name_or_served(llm, case):
    kw, prompt, invalid = case
    note(f"kwargs={_show(kw)} prompt={_show(prompt)} invalid={sorted(invalid)}")
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        _assert_names_a_set_field(exc, kw)
        assert invalid, f"valid values refused: {exc}"
        _outcome("refused by SamplingParams")
        return
    try:
        [out] = llm.generate([prompt], params, use_tqdm=False)
    except ValueError as exc:
        _assert_names_a_set_field(exc, kw, PROMPT_NAMES)
        assert invalid, f"valid values refused: {exc}"
        _assert_engine_idle(llm)
        _outcome("refused by the engine")
        return
    _check_output(llm, out, params, prompt)
    _assert_engine_idle(llm)
    _outcome("served")
    for feature, used in [("n > 1", params.n > 1), ("greedy", params.is_greedy),
                          ("a constraint", params.structured_outputs is not None),
                          ("logprobs", params.logprobs is not None),
                          ("prompt_logprobs", params.prompt_logprobs is not None),
                          ("allowed_token_ids", params.allowed_token_ids is not None),
                          ("bad_words", bool(params.bad_words)), ("stop", bool(params.stop)),
                          ("the long prompt", prompt is LONG_PROMPT)]:
        if used:
            event(f"served with {feature}")


def test_engine_still_serves_after_the_properties(llm):
    """Runs after the property (file order): every rejection left the engine clean, and the
    property exercised all three outcomes."""
    _still_serves(llm)
    if _outcomes:  # the property ran in this session
        assert set(_outcomes) == {"refused by SamplingParams", "refused by the engine",
                                  "served"}, _outcomes


# ---------------------------------------------------------------------------------------
# The constructor alone: many more examples, no model
# ---------------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=sampling_kwargs())
def test_constructor_refuses_by_name_or_normalises(case):
    kw, _, invalid = case
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        _assert_names_a_set_field(exc, kw)
        assert invalid, f"valid values refused: {exc}"
        return
    # Accepted: normalised types, and a clone and a second construction agree.
    assert isinstance(params.stop, list) and isinstance(params.stop_token_ids, list)
    assert all(isinstance(t, int) for t in params.stop_token_ids)
    assert params.logit_bias is None or all(
        type(k) is int and type(v) is float for k, v in params.logit_bias.items())
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        assert type(getattr(params, name)) is float and math.isfinite(getattr(params, name))
    assert params.top_k >= 0 and params.n >= 1
    assert params.clone() == params


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=2), dict(n=2, temperature=1.0, max_tokens=2),
])
def test_a_wrong_message_would_be_caught(kwargs):
    """The property's checker itself: a message not starting with a set field fails it."""
    with pytest.raises(AssertionError):
        _assert_names_a_set_field(ValueError("invalid value for max_tokens"), kwargs)
    with pytest.raises(AssertionError):
        _assert_names_a_set_field(ValueError("top_p must be in (0, 1]"), kwargs)  # not set
    _assert_names_a_set_field(ValueError("max_tokens must be at least 1"), kwargs)


# ---------------------------------------------------------------------------------------
# Regressions the properties found, pinned
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=10**400), "temperature"),  # was OverflowError (int -> float)
    (dict(logit_bias={1: -(10**400)}), "logit_bias"),
    (dict(top_k=2**64), "top_k"),  # was accepted, then failed on the wire to the core
    (dict(truncate_prompt_tokens=2**64), "truncate_prompt_tokens"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(seed=10**5000), "seed"),  # was a ValueError about str() of a 5,000-digit int
    (dict(n=-(10**5000)), "n"),
    (dict(stop_token_ids=[10**5000]), "stop_token_ids"),
    (dict(logit_bias={10**5000: 1.0}), "logit_bias"),
])
def test_huge_numbers_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert _leading_name(str(info.value)) == field, str(info.value)


def test_n_with_unbounded_max_tokens_fits_when_the_room_does(llm):
    # max_tokens is clamped to the room the prompt leaves: 2 x 128 tokens fit in 1,024.
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10**6, ignore_eos=True)
    [out] = llm.generate([LONG_PROMPT], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [8, 8]
    _assert_engine_idle(llm)


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": list(range(200))},
                                    {"text": "no prompt key"}])
def test_prompt_errors_start_with_prompt(llm, prompt):
    with pytest.raises(ValueError, match=r"^prompt\b"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_engine_idle(llm)
