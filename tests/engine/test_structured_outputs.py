"""Constrained decoding through the whole engine, on SmolLM2 (real weights).

The JSON suite runs every schema of tests/structured_output/schema_suite.py constrained and
unconstrained in one batch each: constrained outputs must all parse and validate, while the
same prompts unconstrained mostly fail — the constraint does the work, not the prompt.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from folio import LLM, SamplingParams
from folio.core.request import RequestStatus
from folio.engine.grammar_manager import ReasoningGate
from folio.structured_output.params import StructuredOutputsParams as SO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "structured_output"))
from schema_suite import SCHEMAS  # noqa: E402

VALIDATOR = jsonschema.Draft202012Validator


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_bytes=512 << 20, max_model_len=2048)


def _chat_prompt(llm: LLM, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"{question} Reply with JSON only."}],
        tokenize=False, add_generation_prompt=True)


def _validates(text: str, schema: dict) -> bool:
    try:
        VALIDATOR(schema, format_checker=VALIDATOR.FORMAT_CHECKER).validate(json.loads(text))
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.slow
def test_json_schema_suite_validates_and_unconstrained_does_not(llm):
    prompts = [_chat_prompt(llm, question) for _, question, _ in SCHEMAS]
    # A mild repetition penalty: greedy decoding of a 135M model otherwise loops inside
    # unbounded parts of a schema (recursion, fraction digits) until max_tokens.
    constrained = [SamplingParams(temperature=0, max_tokens=256, repetition_penalty=1.1,
                                  structured_outputs=SO(json=schema, disable_any_whitespace=True))
                   for _, _, schema in SCHEMAS]
    outputs = llm.generate(prompts, constrained, use_tqdm=False)
    failures = [(name, out.outputs[0].finish_reason, out.outputs[0].text)
                for (name, _, schema), out in zip(SCHEMAS, outputs)
                if not _validates(out.outputs[0].text, schema)]
    assert not failures, failures
    assert all(out.outputs[0].finish_reason == "stop" for out in outputs)

    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128,
                                                repetition_penalty=1.1), use_tqdm=False)
    valid_free = sum(_validates(out.outputs[0].text, schema)
                     for (_, _, schema), out in zip(SCHEMAS, free))
    assert valid_free <= len(SCHEMAS) // 4, f"{valid_free} unconstrained outputs validated"


def test_regex_choice_and_grammar(llm):
    prompt = _chat_prompt(llm, "Answer briefly.")
    cases = [
        (SO(regex=r"[0-9]{3}-[A-Z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        (SO(choice=["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
        (SO(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=c)
              for i, (c, _) in enumerate(cases)]
    outputs = llm.generate([prompt] * len(cases), params, use_tqdm=False)
    for (constraint, check), out in zip(cases, outputs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (constraint, text)
        assert check(text), (constraint, text)


def test_neighbours_do_not_change_unconstrained_outputs(llm):
    free_prompts = [_chat_prompt(llm, q) for q in ("Name a city.", "Count to five.",
                                                    "What is tea?")]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(free_prompts, free, use_tqdm=False)
    schema = SCHEMAS[0][2]
    mixed_prompts, mixed_params = [], []
    for prompt in free_prompts:
        mixed_prompts += [prompt, _chat_prompt(llm, "Describe a person.")]
        mixed_params += [free, SamplingParams(temperature=0, max_tokens=40,
                                              structured_outputs=SO(json=schema))]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids for o in alone]
    for out in mixed[1::2]:
        assert _validates(out.outputs[0].text, schema) or out.outputs[0].finish_reason == "length"


def test_max_tokens_inside_the_structure_says_length(llm):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "string"}, "minItems": 20}}, "required": ["items"]}
    [out] = llm.generate([_chat_prompt(llm, "List things.")],
                         SamplingParams(temperature=0, max_tokens=8,
                                        structured_outputs=SO(json=schema)), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8
    assert out.outputs[0].text.startswith("{")


def test_bad_constraints_are_value_errors_naming_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=SO(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    # A schema that parses as JSON but is not a valid schema is found by the front end.
    with pytest.raises(ValueError, match="structured_outputs: invalid json"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(json={"type": "nonsense"})),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine goes on.
    [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_compile_waits_off_the_busy_loop_and_others_go_on(llm):
    """A request whose grammar is compiling waits in WAITING_FOR_GRAMMAR while an
    unconstrained request is scheduled and finishes; then it runs."""
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    release = threading.Event()
    original = manager._compile

    def slow_compile(*args):
        release.wait(timeout=30)
        return original(*args)

    manager._compile = slow_compile
    try:
        engine.add_request("constrained", "Pick one.", SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=SO(choice=["alpha", "beta"])))
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=4))
        finished = {}
        while "free" not in finished:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        [request] = [r for rid, r in engine.engine_core.scheduler.requests.items()
                     if rid.startswith("constrained")]
        assert request.status == RequestStatus.WAITING_FOR_GRAMMAR
        assert request.num_computed_tokens == 0
        release.set()
        deadline = time.monotonic() + 60
        while "constrained" not in finished and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert finished["constrained"].outputs[0].text in ("alpha", "beta")
    finally:
        release.set()
        manager._compile = original


def test_schema_no_backend_enforces_is_refused_or_best_effort(llm):
    """JSONSchemaBench's Github_easy---o89710 (allOf + oneOf): guidance can't prove its oneOfs
    exclusive and xgrammar drops all but one allOf entry (it used to fall back there silently:
    outputs without the required `to`). Refused naming the keyword; with best_effort it runs
    on lenient guidance (oneOf as anyOf), which still enforces the required properties."""
    bench = Path("/work/shared/testdata/jsonschemabench_sample.jsonl")
    schema = next(row["schema"] for row in map(json.loads, bench.read_text().splitlines())
                  if row["id"] == "Github_easy---o89710")
    prompt = _chat_prompt(llm, "Write an email.")
    with pytest.raises(ValueError, match=r"structured_outputs: no backend enforces .*`oneOf`"):
        llm.generate([prompt], SamplingParams(temperature=0.3, seed=0, max_tokens=64,
                                              structured_outputs=SO(json=schema)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    best_effort = SO(json=schema, best_effort=True, disable_any_whitespace=True)
    outs = llm.generate([prompt] * 2, [
        SamplingParams(temperature=0.3, seed=seed, max_tokens=300, repetition_penalty=1.1,
                       structured_outputs=best_effort) for seed in (0, 3)], use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert text.startswith('{"from": ['), text
        if out.outputs[0].finish_reason == "stop":
            value = json.loads(text)
            assert {"from", "to", "bodyParts"} <= set(value), text
            jsonschema.validate(value, schema["allOf"][1] | {"definitions": schema["definitions"]})


def test_grammar_that_fails_in_the_core_finishes_with_error(llm):
    """The front end validates, but a grammar can still fail to compile in the core (here one
    the compiler is made to reject): that request ends with finish_reason "error"; others go on."""
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output
    original = manager._compile

    def failing_compile(params, eos):
        if params.regex == "boom":
            raise ValueError("invalid regex for structured output: boom")
        return original(params, eos)

    manager._compile = failing_compile
    try:
        outs = llm.generate(["A", "B"], [
            SamplingParams(max_tokens=4, temperature=0, structured_outputs=SO(regex="boom")),
            SamplingParams(max_tokens=4, temperature=0)], use_tqdm=False)
    finally:
        manager._compile = original
    assert outs[0].outputs[0].finish_reason == "error" and not outs[0].outputs[0].token_ids
    assert len(outs[1].outputs[0].token_ids) == 4


def test_reasoning_gate_starts_the_constraint_after_the_end_tag():
    start, end = [7], [8, 9]
    # Reasoning closed in the prompt (e.g. enable_thinking=False): constrained from the start.
    assert ReasoningGate(start, end, [1, 7, 8, 9, 2]).ended
    # Opened in the prompt and not closed (deepseek-r1's template): not yet.
    assert not ReasoningGate(start, end, [1, 8, 9, 7]).ended
    gate = ReasoningGate(start, end, [1, 2])
    assert gate.feed([3, 8]) == [] and not gate.ended
    assert gate.feed([9, 4, 5]) == [4, 5] and gate.ended  # end tag split across steps
    assert gate.feed([6]) == [6]


def test_reasoning_gate_when_only_the_prompt_opens_reasoning():
    """deepseek_v3: reasoning only if the prompt leaves a think block open."""
    start, end = [7], [8, 9]
    assert ReasoningGate(start, end, [1, 2], prompt_opens=True).ended  # V3 template: no tags
    assert ReasoningGate(start, end, [1, 7, 3, 8, 9, 5, 8, 9], prompt_opens=True).ended  # V3.1 off
    gate = ReasoningGate(start, end, [1, 8, 9, 5, 7], prompt_opens=True)  # V3.1 thinking
    assert not gate.ended
    assert gate.feed([3, 8, 9, 4]) == [4] and gate.ended


def test_json_after_reasoning_with_a_reasoning_parser():
    """With reasoning_parser=qwen3 the model thinks freely; the schema binds after </think>.
    SmolLM2 never writes </think> by itself, so the prompt ends inside a think block the test
    closes with forced tokens: the grammar must be inactive until then."""
    llm = LLM(kv_cache_memory_bytes=128 << 20, max_model_len=1024,
              structured_outputs_config={"reasoning_parser": "qwen3"})
    tokenizer = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    thinking = tokenizer.encode("<think>Let me think", add_special_tokens=False)
    # Still reasoning: output is free text (not JSON) even though a schema is attached.
    [free] = llm.generate([{"prompt_token_ids": thinking}], SamplingParams(
        temperature=0, max_tokens=6, structured_outputs=SO(json=schema)), use_tqdm=False)
    assert not free.outputs[0].text.lstrip().startswith("{")
    # Reasoning closed in the prompt: the answer is constrained.
    closed = tokenizer.encode("<think>ok</think>", add_special_tokens=False)
    [answer] = llm.generate([{"prompt_token_ids": closed}], SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=SO(json=schema)), use_tqdm=False)
    assert _validates(answer.outputs[0].text, schema), answer.outputs[0].text
