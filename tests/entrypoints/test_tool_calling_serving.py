"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser: the model's tool-call
syntax becomes OpenAI `tool_calls`, streaming (id and name first, then argument fragments) and
not; malformed calls fall back to content; "required" and named functions are forced by a
grammar and parsed from its fixed shape."""
from __future__ import annotations

import json
from typing import Any

from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from test_openai_serving import MESSAGES, MODEL, FakeEngine, _resolve, events, run, tokenizer  # noqa: F401

import pytest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _chat(engine: FakeEngine, *, parser: str | None = "hermes", auto: bool = True, **fields: Any):
    fields.setdefault("model", MODEL)
    fields.setdefault("messages", MESSAGES)
    handler = OpenAIServingChat(engine, [MODEL], tool_call_parser=parser,
                                enable_auto_tool_choice=auto)
    request = ChatCompletionRequest.model_validate(fields)
    return run(_resolve(handler.create_chat_completion(request, request_id="t")))


def test_auto_tool_call_non_streaming(tokenizer):
    engine = FakeEngine(tokenizer, texts=(CALL,))
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    choice = _chat(engine, tools=TOOLS, tool_choice="auto",
                   chat_template=template).model_dump()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["content"].strip() == "Let me check."
    # The tools reached the chat template.
    assert engine.calls[0]["prompt"]["prompt"] == "[get_weather]Say hello"


# 4 tokens a step: as speculative decoding's kept drafts come, a call's markers inside one delta
@pytest.mark.parametrize("per_step", [1, 4])
def test_auto_tool_call_streaming(tokenizer, per_step):
    engine = FakeEngine(tokenizer, texts=(CALL,), tokens_per_step=per_step)
    chunks = [e for e in events(_chat(engine, tools=TOOLS, stream=True)) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call>" not in content and content.strip() == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_malformed_call_falls_back_to_content(tokenizer):
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    engine = FakeEngine(tokenizer, texts=(broken,))
    choice = _chat(engine, tools=TOOLS).model_dump()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == broken and "tool_calls" not in choice["message"]


def test_tool_choice_none_keeps_text(tokenizer):
    engine = FakeEngine(tokenizer, texts=(CALL,))
    choice = _chat(engine, tools=TOOLS, tool_choice="none").model_dump()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("fields, parser, auto, param", [
    (dict(tools=TOOLS, tool_choice="sometimes"), "hermes", True, "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "no_such_tool"}}),
     "hermes", True, "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), None, False, "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     None, False, "tool_choice"),
    (dict(tools=TOOLS), None, False, "tools"),
    (dict(tools=TOOLS), "hermes", False, "tools"),
    (dict(tools=[{"type": "function"}]), "hermes", True, "tools[0]"),
    (dict(tool_choice="auto"), "hermes", True, "tool_choice"),
])
def test_refused_modes_are_400(tokenizer, fields, parser, auto, param):
    engine = FakeEngine(tokenizer, texts=(CALL,))
    with pytest.raises(OpenAIError) as info:
        _chat(engine, parser=parser, auto=auto, **fields)
    assert info.value.status_code == 400 and info.value.param == param


# ---- forced calls (tool_choice "required" / a named function): a grammar shapes the output ----

TWO_TOOLS = TOOLS + [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
REQUIRED_OUT = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                '{"name": "get_time", "parameters": {"zone": "UTC"}}]')


def _constraint_schema(engine: FakeEngine) -> dict:
    constraint = engine.calls[0]["params"].structured_outputs
    assert constraint is not None and constraint.json is not None
    return constraint.json


@pytest.mark.parametrize("parallel", [None, False])
def test_required_sends_an_array_schema_and_parses_calls(tokenizer, parallel):
    engine = FakeEngine(tokenizer, texts=(REQUIRED_OUT,))
    # No --tool-call-parser needed: the grammar fixes the format.
    out = _chat(engine, parser=None, auto=False, tools=TWO_TOOLS, tool_choice="required",
                parallel_tool_calls=parallel).model_dump()["choices"][0]
    schema = _constraint_schema(engine)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == \
        TWO_TOOLS[1]["function"]["parameters"]
    calls = out["message"]["tool_calls"]
    # The grammar allows one call without parallel calls; this fake engine ignores grammars,
    # and the handler still passes on only the first.
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    expected = expected[:1] if parallel is False else expected
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == expected
    assert out["message"]["content"] is None and out["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("per_step", [1, 4])
def test_required_streams_name_then_argument_fragments(tokenizer, per_step):
    engine = FakeEngine(tokenizer, texts=(REQUIRED_OUT,), tokens_per_step=per_step)
    chunks = [e for e in events(_chat(engine, parser=None, auto=False, tools=TWO_TOOLS,
                                      tool_choice="required", stream=True)) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    heads = [tc for tc in calls if tc.get("id")]
    assert [h["function"]["name"] for h in heads] == ["get_weather", "get_time"]
    for index, expected in ((0, {"city": "Paris"}), (1, {"zone": "UTC"})):
        args = "".join(tc["function"].get("arguments") or "" for tc in calls
                       if tc["index"] == index)
        assert json.loads(args) == expected
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_function_constrains_to_its_parameters(tokenizer):
    engine = FakeEngine(tokenizer, texts=('{"zone": "CET"}',))
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = _chat(engine, parser=None, auto=False, tools=TWO_TOOLS,
                tool_choice=choice).model_dump()["choices"][0]
    assert _constraint_schema(engine) == TWO_TOOLS[1]["function"]["parameters"]
    [call] = out["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"zone": "CET"}
    assert out["finish_reason"] == "stop"  # OpenAI's finish_reason for a forced function

    engine = FakeEngine(tokenizer, texts=('{"zone": "CET"}',))
    chunks = [e for e in events(_chat(engine, parser=None, auto=False, tools=TWO_TOOLS,
                                      tool_choice=choice, stream=True)) if e != "[DONE]"]
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == \
        {"zone": "CET"}


def test_cut_off_forced_call_is_content_with_length(tokenizer):
    engine = FakeEngine(tokenizer, texts=('[{"name": "get_weather", "parameters": {"ci',))
    out = _chat(engine, parser=None, auto=False, tools=TOOLS,
                tool_choice="required").model_dump()["choices"][0]
    assert "tool_calls" not in out["message"]
    assert out["message"]["content"].startswith('[{"name"')


def test_strict_functions_under_auto_use_a_structural_tag(tokenizer):
    strict = [{"type": "function", "function": dict(TOOLS[0]["function"], strict=True)}]
    engine = FakeEngine(tokenizer, texts=(CALL,))
    _chat(engine, tools=strict, tool_choice="auto")
    constraint = engine.calls[0]["params"].structured_outputs
    tag = json.loads(constraint.structural_tag)
    assert tag["triggers"] == ["<tool_call>"]
    [structure] = tag["structures"]
    assert structure["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert structure["schema"] == TOOLS[0]["function"]["parameters"]
    # Without strict, auto leaves the output free.
    engine = FakeEngine(tokenizer, texts=(CALL,))
    _chat(engine, tools=TOOLS, tool_choice="auto")
    assert engine.calls[0]["params"].structured_outputs is None


def test_response_format_reaches_sampling_params(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    engine = FakeEngine(tokenizer, texts=('{"a": 1}',))
    _chat(engine, parser=None, auto=False, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert engine.calls[0]["params"].structured_outputs.json == schema
    engine = FakeEngine(tokenizer, texts=('{"a": 1}',))
    _chat(engine, parser=None, auto=False, response_format={"type": "json_object"})
    assert engine.calls[0]["params"].structured_outputs.json_object is True


TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(tokenizer, parallel):
    engine = FakeEngine(tokenizer, texts=(TWO_CALLS,))
    calls = _chat(engine, tools=TOOLS, parallel_tool_calls=parallel).model_dump()[
        "choices"][0]["message"]["tool_calls"]
    cities = [json.loads(c["function"]["arguments"])["city"] for c in calls]
    assert cities == (["Paris"] if parallel is False else ["Paris", "Rome"])

    engine = FakeEngine(tokenizer, texts=(TWO_CALLS,))
    chunks = [e for e in events(_chat(engine, tools=TOOLS, parallel_tool_calls=parallel,
                                      stream=True)) if e != "[DONE]"]
    streamed = [tc for c in chunks if c["choices"]
                for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert {tc["index"] for tc in streamed} == ({0} if parallel is False else {0, 1})
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
