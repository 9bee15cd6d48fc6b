"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser: the model's tool-call
syntax becomes OpenAI `tool_calls`, streaming (id and name first, then argument fragments) and
not; malformed calls fall back to content; modes that need constrained decoding are refused."""
from __future__ import annotations

import json
from typing import Any

from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.entrypoints.openai.serving_common import OpenAIError
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


def test_auto_tool_call_streaming(tokenizer):
    engine = FakeEngine(tokenizer, texts=(CALL,))
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
    (dict(tools=TOOLS, tool_choice="required"), "hermes", True, "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "hermes", True, "tool_choice"),
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
