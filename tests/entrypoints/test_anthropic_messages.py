"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) end to end, driven by the
official `anthropic` SDK: a real `folio serve` of the default model (SmolLM2-135M-Instruct,
trained, so greedy output is stable) with the real Qwen3 chat template (tools, tool results,
thinking switch; fetched by fixtures_tokenizers), the hermes tool-call parser and the qwen3
reasoning parser, behind an API key.

The chat template and parsers are the chat route's, so a create must answer what
/v1/chat/completions answers for the same conversation. SmolLM2 never writes a think block,
so the thinking blocks (and the auto tool-call parse) are checked in process, against a
scripted engine, with the SDK talking to the app over an ASGI transport.

This SDK's messages.create has no temperature parameter (Anthropic dropped the sampling
fields from it); the server still reads it, and the tests send it in extra_body.

The server runs with OMP_NUM_THREADS=1: on a busy 2-core machine torch's default two threads
made every decode step much slower (see test_structured_server.py).
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server_utils import RemoteServer, qwen3_chat_template_file
from test_openai_serving import FakeEngine, tokenizer  # noqa: F401

API_KEY = "anthropic-test-key"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [
    {"name": "get_weather", "description": "Get the current weather in a city",
     "input_schema": WEATHER},
    {"name": "get_time", "description": "Get the local time in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}},
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_STOP_SEQUENCES = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = qwen3_chat_template_file(tmp_path_factory.mktemp("anthropic"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = RemoteServer(["--max-model-len", "2048", "--num-gpu-blocks-override", "256",
                            "--dtype", "float32", "--max-num-seqs", "16",
                            "--chat-template", template,
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--reasoning-parser", "qwen3",
                            "--max-stop-strings", str(MAX_STOP_SEQUENCES)], api_key=API_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _create(client: anthropic.Anthropic, **kwargs: Any):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("max_tokens", 32)
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("extra_body", GREEDY)
    return client.messages.create(**kwargs)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _prompt_tokens(usage) -> int:
    # Anthropic counts cache reads apart from input_tokens; the three make the prompt.
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + \
        (usage.cache_creation_input_tokens or 0)


# ---- create, stream, count_tokens --------------------------------------------------------

def test_create_matches_chat_completions(server, client):
    message = _create(client, system=SYSTEM)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
        temperature=0, max_tokens=32)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert "Paris" in block.text
    assert chat.choices[0].finish_reason == "stop" and message.stop_reason == "end_turn"
    assert message.stop_sequence is None
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert _prompt_tokens(message.usage) == chat.usage.prompt_tokens


def test_reply_has_exactly_anthropics_keys(server):
    response = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 4, "messages": QUESTION, **GREEDY},
        headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "type", "role", "model", "content", "stop_reason",
                         "stop_sequence", "usage"}
    assert set(body["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens"}
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 4


def test_stream_matches_create(client):
    message = _create(client, system=SYSTEM)
    events = list(_create(client, system=SYSTEM, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert _prompt_tokens(start.usage) == _prompt_tokens(message.usage)
    assert events[1].index == 0 and events[1].content_block.type == "text"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == _text(message)
    delta = events[-2]
    assert delta.delta.stop_reason == message.stop_reason == "end_turn"
    assert delta.usage.output_tokens == message.usage.output_tokens
    # The SDK's own accumulation of the events gives the same message.
    with client.messages.stream(model=MODEL, max_tokens=32, messages=QUESTION, system=SYSTEM,
                                extra_body=GREEDY) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == _text(final) == _text(message)
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_stream_wire_format(server):
    """event: lines naming each event (ping included), no OpenAI [DONE]."""
    with httpx.stream("POST", server.url + "/v1/messages", timeout=120, json={
            "model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True, **GREEDY},
            headers={"x-api-key": API_KEY}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    for frame, name in zip(frames, names):
        assert json.loads(frame.split("\n")[1].removeprefix("data: "))["type"] == name
    assert "[DONE]" not in raw


def test_count_tokens_is_the_prompt_create_runs(client):
    message = _create(client, system=SYSTEM, max_tokens=1)
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert count.input_tokens == _prompt_tokens(message.usage)
    # The tools are part of the rendered prompt, and counted as create runs them (a forced
    # call also turns the template's thinking off, so tool_choice counts too).
    choice = {"type": "tool", "name": "get_weather"}
    with_tools = client.messages.count_tokens(model=MODEL, messages=WEATHER_QUESTION,
                                              tools=TOOLS, tool_choice=choice)
    forced = _create(client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                     tool_choice=choice)
    assert with_tools.input_tokens == _prompt_tokens(forced.usage)
    assert with_tools.input_tokens > client.messages.count_tokens(
        model=MODEL, messages=WEATHER_QUESTION).input_tokens


def test_stop_sequences(client):
    full = _text(_create(client))
    assert " is " in full
    message = _create(client, stop_sequences=["never there", " is "])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " is "
    assert _text(message) == full[:full.index(" is ")]
    delta = [e for e in _create(client, stop_sequences=[" is "], stream=True)
             if e.type == "message_delta"][0]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", " is ")


def test_max_tokens(client):
    message = _create(client, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert message.stop_sequence is None


# ---- tools -------------------------------------------------------------------------------

def _tool_use(message) -> Any:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses, message
    return uses[0]


def test_tool_choice_any_forces_a_valid_call(client):
    message = _create(client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                      tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    call = _tool_use(message)
    assert call.id.startswith("toolu_") and call.name in {t["name"] for t in TOOLS}
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(call.input, schema)


def test_tool_choice_tool_streams_input_json(client):
    choice = {"type": "tool", "name": "get_weather"}
    message = _create(client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                      tool_choice=choice)
    call = _tool_use(message)
    assert call.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    events = list(_create(client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                          tool_choice=choice, stream=True))
    [start] = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.id.startswith("toolu_") and start.content_block.input == {}
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events
               if e.type == "content_block_delta")
    assert json.loads("".join(fragments)) == call.input
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"


def test_tool_use_tool_result_answer(client):
    call = _tool_use(_create(client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=100,
                             tool_choice={"type": "tool", "name": "get_weather"}))

    def conversation(result: str) -> list[dict]:
        return [*WEATHER_QUESTION,
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": result}]}]

    answer = _create(client, messages=conversation("22 degrees and sunny"), tools=TOOLS,
                     max_tokens=24)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text" and _text(answer)
    # The call and its result reached the template (its <tool_response>): a longer result
    # is a longer prompt, and the count is the prompt create ran.
    count = client.messages.count_tokens(model=MODEL, tools=TOOLS,
                                         messages=conversation("22 degrees and sunny"))
    assert count.input_tokens == _prompt_tokens(answer.usage)
    longer = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=conversation(
        "22 degrees and sunny, with a light wind from the west"))
    assert longer.input_tokens > count.input_tokens


# ---- errors and auth ---------------------------------------------------------------------

def _anthropic_body(exc: anthropic.APIStatusError, kind: str) -> str:
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    assert set(exc.body) == {"type", "error"} and set(exc.body["error"]) == {"type", "message"}
    return exc.body["error"]["message"]


@pytest.mark.parametrize("fields, mention", [
    (dict(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]), "messages[0].content[1]"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(extra_body={"temperature": 1.5}), "temperature"),
    (dict(stop_sequences=[f"stop{i}" for i in range(MAX_STOP_SEQUENCES + 1)]), "stop_sequences"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "no_such_tool"}), "no_such_tool"),
    (dict(tools=[{"name": "t", "input_schema": {"type": "object"}}] * 200), "tools"),
    (dict(thinking={"type": "enabled", "budget_tokens": 2048}), "budget_tokens"),
    (dict(messages=[{"role": "system", "content": "no"}]), "messages[0].role"),
])
def test_bad_requests_are_400s(client, fields, mention):
    with pytest.raises(anthropic.BadRequestError) as info:
        _create(client, **fields)
    assert info.value.status_code == 400
    assert mention in _anthropic_body(info.value, "invalid_request_error")


def test_unknown_model_is_404(server, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        _create(client, model="claude-no-such-model")
    assert info.value.status_code == 404
    assert "claude-no-such-model" in _anthropic_body(info.value, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-no-such-model", messages=QUESTION)
    # The OpenAI routes keep OpenAI's shape.
    response = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                          json={"model": "claude-no-such-model", "messages": QUESTION})
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"


def test_wrong_or_missing_key_is_401(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        _create(bad)
    assert info.value.status_code == 401
    _anthropic_body(info.value, "authentication_error")
    response = httpx.post(server.url + "/v1/messages", json={
        "model": MODEL, "max_tokens": 4, "messages": QUESTION})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    response = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "messages": QUESTION})
    assert response.status_code == 401 and "message" in response.json()["error"]


def test_x_api_key_is_the_api_key(server, monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # This SDK sends api_key as a bearer token; Anthropic's own header is x-api-key.
    client = anthropic.Anthropic(base_url=server.url, max_retries=0,
                                 default_headers={"x-api-key": API_KEY})
    assert _create(client, max_tokens=2).stop_reason == "max_tokens"
    # Everywhere the key is checked, not only on Anthropic's routes.
    response = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                          headers={"x-api-key": API_KEY},
                          json={"model": MODEL, "max_tokens": 2, "messages": QUESTION})
    assert response.status_code == 200, response.text
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_server_goes_on_after_errors(server, client):
    for body in ({"model": MODEL}, {"model": MODEL, "max_tokens": 0, "messages": QUESTION},
                 {"model": MODEL, "max_tokens": 4, "messages": QUESTION,
                  "tools": [{"name": "deep", "input_schema": _nested(80)}]}):
        response = httpx.post(server.url + "/v1/messages", json=body,
                              headers={"x-api-key": API_KEY}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error"
    assert "Paris" in _text(_create(client))
    assert httpx.get(server.url + "/health").status_code == 200


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# ---- thinking and the auto tool-call parse, in process -----------------------------------

SCRIPTED = ('<think>The user wants the weather.</think>Let me check. '
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}</tool_call>')


def _scripted_client(tokenizer: Any, text: str, chat_template: str | None = None,
                     tool_call_parser: str | None = "hermes"
                     ) -> tuple[anthropic.AsyncAnthropic, Any]:
    """The SDK against the app in process, its engine scripted to "generate" `text`."""
    import httpx2
    from folio.entrypoints.openai.api_server import ServerSettings, build_app
    engine = FakeEngine(tokenizer, max_model_len=4096, texts=(text,))
    engine.is_healthy, engine.errored = True, None
    engine.model_info = SimpleNamespace(source=SimpleNamespace(path="/models/smol"),
                                        vocab_size=len(tokenizer), pooling=None)
    engine.shutdown = lambda: None
    app = build_app(engine, ServerSettings(served_model_names=[MODEL], reasoning_parser="qwen3",
                                           tool_call_parser=tool_call_parser,
                                           enable_auto_tool_choice=tool_call_parser is not None,
                                           chat_template=chat_template))
    transport = httpx2.ASGITransport(app=app)
    return anthropic.AsyncAnthropic(base_url="http://folio", api_key="none", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport)), engine


def test_thinking_and_auto_tool_call_blocks(tokenizer):  # noqa: F811
    client, engine = _scripted_client(tokenizer, SCRIPTED)
    thinking = {"type": "enabled", "budget_tokens": 1024}

    async def run() -> tuple[Any, list[Any], Any, Any]:
        message = await client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION,
                                               tools=TOOLS, thinking=thinking)
        events = [e async for e in await client.messages.create(
            model=MODEL, max_tokens=2048, messages=QUESTION, tools=TOOLS, thinking=thinking,
            stream=True)]
        async with client.messages.stream(model=MODEL, max_tokens=2048, messages=QUESTION,
                                          tools=TOOLS, thinking=thinking) as stream:
            final = await stream.get_final_message()
        off = await client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION,
                                           tools=TOOLS, thinking={"type": "disabled"})
        return message, events, final, off

    message, events, final, off = asyncio.run(run())
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "The user wants the weather."
    assert message.content[1].text == "Let me check. "
    call = message.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "unit": "celsius"}
    assert message.stop_reason == "tool_use"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    kinds = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta", "input_json_delta"}
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == message.content[0].thinking
    assert final.content[2].input == call.input and final.stop_reason == "tool_use"
    # Thinking off: the think tags are plain text (the parser does not split them).
    assert off.content[0].type == "text" and off.content[0].text.startswith("<think>")


def test_thinking_switch_reaches_the_template(tokenizer):  # noqa: F811
    """thinking enabled / disabled set the template's enable_thinking (the qwen3 format's
    switch); no thinking field leaves the model's default. count_tokens renders the same."""
    template = ("{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    client, engine = _scripted_client(tokenizer, "Hello.", chat_template=template)
    settings = (None, {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"})

    async def run() -> list[int]:
        counts = []
        for thinking in settings:
            extra = {} if thinking is None else {"thinking": thinking}
            await client.messages.create(model=MODEL, max_tokens=2048, messages=QUESTION,
                                         system=SYSTEM, extra_body=GREEDY, **extra)
            counts.append((await client.messages.count_tokens(
                model=MODEL, messages=QUESTION, system=SYSTEM, **extra)).input_tokens)
        return counts

    counts = asyncio.run(run())
    conversation = f"system: {SYSTEM}\nuser: What is the capital of France?\n"
    prompts = [call["prompt"]["prompt"] for call in engine.calls]
    assert prompts == [conversation, "[thinking=True]" + conversation,
                       "[thinking=False]" + conversation]
    assert counts == [len(call["prompt"]["prompt_token_ids"]) for call in engine.calls]
    assert all(call["params"].temperature == 0 for call in engine.calls)


def test_tool_choice_without_a_tool_call_parser(tokenizer):  # noqa: F811
    """As on the chat route: auto needs the server's parser (400 without one); any / tool are
    forced by a grammar and parsed from its shape, so they need none."""
    forced = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    client, engine = _scripted_client(tokenizer, forced, tool_call_parser=None)

    async def run() -> tuple[Any, Any, Any]:
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model=MODEL, max_tokens=64, messages=QUESTION,
                                         tools=TOOLS)
        any_call = await client.messages.create(model=MODEL, max_tokens=64, messages=QUESTION,
                                                tools=TOOLS, tool_choice={"type": "any"})
        none = await client.messages.create(model=MODEL, max_tokens=64, messages=QUESTION,
                                            tools=TOOLS, tool_choice={"type": "none"})
        return info.value, any_call, none

    error, any_call, none = asyncio.run(run())
    assert "--enable-auto-tool-choice" in _anthropic_body(error, "invalid_request_error")
    [call] = any_call.content
    assert call.type == "tool_use" and call.input == {"city": "Paris", "unit": "celsius"}
    assert any_call.stop_reason == "tool_use"
    schema = engine.calls[0]["params"].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert none.content[0].type == "text" and none.stop_reason == "end_turn"


@pytest.mark.parametrize("status, sent, kind", [
    (400, 400, "invalid_request_error"), (401, 401, "authentication_error"),
    (404, 404, "not_found_error"), (413, 413, "request_too_large"),
    (429, 429, "rate_limit_error"), (500, 500, "api_error"), (503, 529, "overloaded_error"),
    (405, 405, "invalid_request_error")])
def test_error_types_by_status(status, sent, kind):
    from folio.entrypoints.openai.anthropic_responses import error_status_and_body
    assert error_status_and_body(status, "why") == (
        sent, {"type": "error", "error": {"type": kind, "message": "why"}})
