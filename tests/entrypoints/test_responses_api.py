"""OpenAI's Responses API (/v1/responses) end to end, driven by the official `openai` SDK: a
real `folio serve` of the default model (SmolLM2-135M-Instruct, trained, so greedy output is
stable) with the real Qwen3 chat template (tools, tool results, thinking switch; fetched by
fixtures_tokenizers), the hermes tool-call parser and the qwen3 reasoning parser, behind an API
key.

The chat template and parsers are the chat route's, so a create must answer what
/v1/chat/completions answers for the same conversation. SmolLM2 never writes a think block,
so reasoning items (and the auto tool-call parse) are checked in process, against a scripted
engine, with the SDK talking to the app over an ASGI transport; so are background runs that
must still be running when they are polled or cancelled. The store's bounds (LRU, TTL, the
SQLite file) are unit-tested without a server.

The server runs with OMP_NUM_THREADS=1: on a busy 2-core machine torch's default two threads
made every decode step much slower (see test_structured_server.py).
"""
from __future__ import annotations

import asyncio
import json
import time
from array import array
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server_utils import RemoteServer, qwen3_chat_template_file
from test_openai_serving import FakeEngine, tokenizer  # noqa: F401

from folio.entrypoints.openai.responses_store import ResponseStore, StoredResponse

API_KEY = "responses-test-key"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what is the capital of Germany?"
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
     "parameters": WEATHER, "strict": None},
    {"type": "function", "name": "get_time", "description": "Get the local time in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}, "strict": None},
]
# The grammar of a forced call or a json_schema starts after the reasoning (the engine's
# reasoning gate): with thinking off the Qwen3 template closes an empty think block in the
# prompt, so a model that never thinks (SmolLM2) is constrained from its first token.
NO_THINKING = {"effort": "none"}
# The response object's keys (OpenAI's, as this server sends them).
RESPONSE_KEYS = {"id", "object", "created_at", "status", "completed_at", "error",
                 "incomplete_details", "model", "output", "usage", "background", "instructions",
                 "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
                 "previous_response_id", "reasoning", "store", "temperature", "text",
                 "tool_choice", "tools", "top_p", "truncation", "user"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = qwen3_chat_template_file(tmp_path_factory.mktemp("responses"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = RemoteServer(["--max-model-len", "2048", "--num-gpu-blocks-override", "256",
                            "--dtype", "float32", "--max-num-seqs", "16",
                            "--chat-template", template,
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--reasoning-parser", "qwen3",
                            "--responses-store-max-entries", "256",
                            "--responses-max-background", "4"], api_key=API_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(timeout=120)


def _create(client: openai.OpenAI, **kwargs: Any):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("max_output_tokens", 32)
    kwargs.setdefault("input", QUESTION)
    kwargs.setdefault("temperature", 0)
    return client.responses.create(**kwargs)


def _chat_text(server, messages: list[dict], max_tokens: int = 32) -> str:
    chat = server.client().chat.completions.create(model=MODEL, messages=messages,
                                                   temperature=0, max_tokens=max_tokens)
    return chat.choices[0].message.content


def _raw(server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=server.headers, timeout=120,
                         **kwargs)


def _events(raw: str) -> list[dict]:
    """An SSE body -> the events' JSON; each frame's `event:` line names its type."""
    out = []
    for frame in filter(None, raw.split("\n\n")):
        event_line, data_line = frame.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        out.append(payload)
    return out


# ---- create, stream -----------------------------------------------------------------------

def test_create_matches_chat_completions(server, client):
    response = _create(client, instructions=SYSTEM)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=32)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text == chat.choices[0].message.content
    assert "Paris" in response.output_text
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == SYSTEM and response.temperature == 0
    assert response.store is True and response.background is False


def test_response_object_has_openais_keys(server):
    response = _raw(server, "POST", "/v1/responses", json={
        "model": MODEL, "input": QUESTION, "max_output_tokens": 4, "temperature": 0,
        "metadata": {"run": "keys"}, "user": "tester"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == RESPONSE_KEYS
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert set(body["usage"]) == {"input_tokens", "input_tokens_details", "output_tokens",
                                  "output_tokens_details", "total_tokens"}
    assert body["usage"]["output_tokens"] == 4
    assert body["metadata"] == {"run": "keys"} and body["user"] == "tester"
    assert body["text"] == {"format": {"type": "text"}} and body["tool_choice"] == "auto"
    assert body["tools"] == [] and body["parallel_tool_calls"] is True


def test_stream_matches_create(client):
    response = _create(client)
    events = list(_create(client, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == response.output_text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text
    assert events[-2].item.content[0].text == text
    assert final.usage.output_tokens == response.usage.output_tokens


def test_stream_wire_format(server):
    """`event:` lines naming each event; no [DONE] (the Responses API sends none)."""
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers,
                      timeout=120, json={"model": MODEL, "input": QUESTION, "stream": True,
                                         "max_output_tokens": 4, "temperature": 0}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert "[DONE]" not in raw
    events = _events(raw)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    assert set(delta) == {"type", "sequence_number", "item_id", "output_index",
                          "content_index", "delta", "logprobs"}


# ---- stored responses ---------------------------------------------------------------------

def test_previous_response_id_continues_and_reuses_the_cache(server, client):
    first = _create(client, instructions=SYSTEM, max_output_tokens=16)
    second = _create(client, previous_response_id=first.id, input=FOLLOW_UP)
    assert second.previous_response_id == first.id and second.instructions is None
    # The conversation so far (instructions are not carried over, as OpenAI's are not).
    expected = _chat_text(server, [{"role": "user", "content": QUESTION},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": FOLLOW_UP}])
    assert second.output_text == expected
    # The first prompt's blocks are still in the prefix cache: the continuation reuses them.
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached < second.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert all(i.id for i in items.data) and items.has_more is False


def test_retrieve_then_delete(client):
    response = _create(client, max_output_tokens=8)
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    assert client.responses.delete(response.id) is None
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(response.id)
    assert info.value.status_code == 404 and response.id in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        _create(client, previous_response_id=response.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"


def test_store_false_is_not_kept(client):
    response = _create(client, store=False, max_output_tokens=4)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_background_runs_to_completion(client):
    expected = _create(client).output_text
    queued = _create(client, background=True)
    assert queued.background is True and queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 120
    response = queued
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        response = client.responses.retrieve(queued.id)
    assert response.status == "completed" and response.output_text == expected
    # Finished: cancelling it changes nothing (OpenAI's rule).
    assert client.responses.cancel(queued.id).status == "completed"


def test_background_cancel(client):
    story = _create(client, background=True, input="Write a long story about a dragon.",
                    max_output_tokens=1500)
    cancelled = client.responses.cancel(story.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(story.id).status == "cancelled"
    assert client.responses.cancel(story.id).status == "cancelled"
    assert cancelled.usage is None and len(cancelled.output_text) < 1500 * 8
    # The engine request was aborted (checked in process below); the server goes on.
    assert "Paris" in _create(client).output_text


def test_stored_responses_survive_a_restart(tmp_path):
    """--responses-store-path: a response stored by one server is retrieved and continued by
    the next one on the same file."""
    args = ["--max-model-len", "512", "--num-gpu-blocks-override", "64", "--dtype", "float32",
            "--responses-store-path", str(tmp_path / "responses.sqlite")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        with RemoteServer(args) as first_server:
            first = _create(first_server.client(), max_output_tokens=8)
        with RemoteServer(args) as second_server:
            client = second_server.client()
            assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
            second = _create(client, previous_response_id=first.id, input=FOLLOW_UP,
                             max_output_tokens=4)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# ---- tools, structured output -------------------------------------------------------------

def _call(response) -> Any:
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, response.output
    return calls[0]


def test_forced_tool_call_then_its_output(client):
    forced = {"type": "function", "name": "get_weather"}
    response = _create(client, input=WEATHER_QUESTION, tools=TOOLS, tool_choice=forced,
                       reasoning=NO_THINKING, max_output_tokens=100)
    call = _call(response)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tool_choice.name == "get_weather"
    # Streamed: the item is added with its name, its arguments come as deltas.
    events = list(_create(client, input=WEATHER_QUESTION, tools=TOOLS, tool_choice=forced,
                          reasoning=NO_THINKING, max_output_tokens=100, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(fragments) == done.arguments
    assert json.loads(done.arguments) == json.loads(call.arguments)
    # The call's output, continuing the stored conversation: the model answers.
    answer = _create(client, previous_response_id=response.id, tools=TOOLS, tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": "22 degrees and sunny"}], max_output_tokens=24)
    assert answer.output[0].type == "message" and answer.output_text
    kinds = [item.type for item in client.responses.input_items.list(answer.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output"]


CAPITAL = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
                          "is_capital": {"type": "boolean"}},
           "required": ["city", "is_capital"], "additionalProperties": False}


def test_text_format_json_schema(client):
    response = _create(client, reasoning=NO_THINKING, max_output_tokens=64, text={
        "format": {"type": "json_schema", "name": "capital", "schema": CAPITAL,
                   "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CAPITAL)
    assert response.text.format.type == "json_schema"


# ---- errors and auth ----------------------------------------------------------------------

def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields, status, param, mention", [
    (dict(previous_response_id="resp_nope"), 404, "previous_response_id", "resp_nope"),
    (dict(background=True, store=False), 400, "background", "store"),
    (dict(tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}]),
     400, "tools[0].type", "file_search, web_search"),
    (dict(max_output_tokens=100_000), 400, "max_output_tokens", "max_output_tokens"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     400, "input[0].content[0]", "input_image"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "no_such_tool"}), 400,
     "tool_choice", "no_such_tool"),
    (dict(text={"format": {"type": "json_schema", "name": "deep", "schema": _nested(40)}}),
     400, "text.format.schema", "--max-schema-depth"),
])
def test_bad_requests(client, fields, status, param, mention):
    with pytest.raises(openai.APIStatusError) as info:
        _create(client, **fields)
    assert info.value.status_code == status, info.value.body
    body = info.value.body
    assert body["param"] == param, body
    assert mention is None or mention in body["message"]


def test_unknown_response_is_404(client):
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as info:
            call("resp_does_not_exist")
        assert info.value.body["type"] == "invalid_request_error"


def test_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        _create(bad)
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/resp_x/cancel"),
                         ("GET", "/v1/responses/resp_x/input_items")):
        assert httpx.request(method, server.url + path).status_code == 401


# ---- in process: reasoning items, auto tool calls, background runs -----------------------

SCRIPTED = ('<think>The user wants the weather.</think>Let me check. '
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>')


def _scripted_client(tokenizer: Any, text: str, step_delay_s: float = 0.0,
                     tokens_per_step: int = 1, **settings: Any
                     ) -> tuple[openai.AsyncOpenAI, Any]:
    """The SDK against the app in process, its engine scripted to "generate" `text`,
    `tokens_per_step` tokens a step."""
    from folio.entrypoints.openai.api_server import ServerSettings, build_app
    engine = FakeEngine(tokenizer, max_model_len=4096, texts=(text,), step_delay_s=step_delay_s,
                        tokens_per_step=tokens_per_step)
    engine.is_healthy, engine.errored = True, None
    engine.model_info = SimpleNamespace(source=SimpleNamespace(path="/models/smol"),
                                        vocab_size=len(tokenizer), pooling=None)
    engine.shutdown = lambda: None
    app = build_app(engine, ServerSettings(served_model_names=[MODEL], reasoning_parser="qwen3",
                                           tool_call_parser="hermes",
                                           enable_auto_tool_choice=True, **settings))
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(base_url="http://folio/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport)), engine


def test_reasoning_and_auto_tool_call_items(tokenizer):  # noqa: F811
    client, _ = _scripted_client(tokenizer, SCRIPTED)

    async def run() -> tuple[Any, list[Any], Any]:
        response = await client.responses.create(model=MODEL, input=WEATHER_QUESTION,
                                                 tools=TOOLS)
        events = [e async for e in await client.responses.create(
            model=MODEL, input=WEATHER_QUESTION, tools=TOOLS, stream=True)]
        one = await client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=TOOLS,
                                            parallel_tool_calls=False)
        return response, events, one

    response, events, one = asyncio.run(run())
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call",
                                                      "function_call"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "The user wants the weather."
    assert response.output_text == "Let me check. "
    calls = response.output[2:]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert response.usage.output_tokens_details.reasoning_tokens == len(tokenizer.encode(
        "The user wants the weather.", add_special_tokens=False))
    # Streamed: the same items, each opened, grown and closed in turn.
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    kinds = {e.type for e in events if e.type.endswith(".delta")}
    assert kinds == {"response.reasoning_text.delta", "response.output_text.delta",
                     "response.function_call_arguments.delta"}
    reasoning_text = "".join(e.delta for e in events
                             if e.type == "response.reasoning_text.delta")
    assert reasoning_text == reasoning.content[0].text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # parallel_tool_calls=false: one call at most.
    assert [item.type for item in one.output] == ["reasoning", "message", "function_call"]


def _create_and_stream(client: openai.AsyncOpenAI, **fields: Any) -> tuple[Any, list[Any]]:
    """The response created, and the events of the same request streamed."""
    async def run() -> tuple[Any, list[Any]]:
        response = await client.responses.create(model=MODEL, input=WEATHER_QUESTION, **fields)
        events = [e async for e in await client.responses.create(
            model=MODEL, input=WEATHER_QUESTION, stream=True, **fields)]
        return response, events
    return asyncio.run(run())


def test_steps_of_several_tokens_stream_the_same_items(tokenizer):  # noqa: F811
    """Steps that bring several tokens (speculative decoding's kept drafts), so that the end
    of the reasoning, a call's start and its end fall inside one delta: the streamed items and
    the created response are those of one token a step."""
    def outputs(per_step: int) -> tuple[list[dict], list[dict], str, str]:
        client, _ = _scripted_client(tokenizer, SCRIPTED, tokens_per_step=per_step)
        response, events = _create_and_stream(client, tools=TOOLS)

        def shape(items: list[Any]) -> list[dict]:
            return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
                    for item in items]
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        reasoning = "".join(e.delta for e in events
                            if e.type == "response.reasoning_text.delta")
        return shape(response.output), shape(events[-1].response.output), text, reasoning

    one = outputs(1)
    assert one[0] == one[1]
    assert (one[2], one[3]) == ("Let me check. ", "The user wants the weather.")
    for per_step in (3, 7):
        assert outputs(per_step) == one, per_step


def test_reasoning_alone_is_one_item_streamed_or_not(tokenizer):  # noqa: F811
    """A reply that is only reasoning: the reasoning item alone, created or streamed (the
    created response had carried an empty message after it, which the stream had not)."""
    client, _ = _scripted_client(tokenizer, "<think>Only thinking here.</think>")
    response, events = _create_and_stream(client)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == "Only thinking here."
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in final.output] == ["reasoning"]
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == \
        ["reasoning"]


def test_a_newline_between_calls_is_no_message_streamed_or_not(tokenizer):  # noqa: F811
    """Two calls with a newline between them (as models write them): two function_call
    items, created or streamed (the stream had sent the newline as a message of its own)."""
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>\n')
    client, _ = _scripted_client(tokenizer, text)
    response, events = _create_and_stream(client, tools=TOOLS)
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == \
        ["function_call", "function_call"]
    assert [item.type for item in events[-1].response.output] == \
        ["function_call", "function_call"]


def test_background_poll_shows_progress_and_cancel_aborts(tokenizer):  # noqa: F811
    long_text = " ".join(["word"] * 200)
    client, engine = _scripted_client(tokenizer, long_text, step_delay_s=0.01)

    async def run() -> tuple[Any, Any, Any]:
        queued = await client.responses.create(model=MODEL, input=QUESTION, background=True)
        polled = queued
        while not (polled.output and polled.output[0].content
                   and polled.output[0].content[0].text):
            await asyncio.sleep(0.01)
            polled = await client.responses.retrieve(queued.id)
        cancelled = await client.responses.cancel(queued.id)
        return queued, polled, cancelled

    queued, polled, cancelled = asyncio.run(run())
    assert queued.status == "queued" and queued.output == []
    assert polled.status == "in_progress" and polled.output[0].status == "in_progress"
    assert cancelled.status == "cancelled"
    assert len(cancelled.output_text) < len(long_text)
    assert engine.aborted == [queued.id]


def test_background_stream_and_bound(tokenizer):  # noqa: F811
    client, _ = _scripted_client(tokenizer, "Hello there.", step_delay_s=0.01)

    async def run() -> tuple[list[Any], Any]:
        stream = await client.responses.create(model=MODEL, input=QUESTION, background=True,
                                               stream=True)
        events = [e async for e in stream]
        return events, await client.responses.retrieve(events[0].response.id)

    events, stored = asyncio.run(run())
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello there." == stored.output_text


def test_background_runs_are_bounded(tokenizer):  # noqa: F811
    from folio.entrypoints.openai.responses_store import ResponsesConfig
    client, _ = _scripted_client(tokenizer, " ".join(["word"] * 100), step_delay_s=0.01,
                                 responses=ResponsesConfig(max_background=1))

    async def run() -> Any:
        first = await client.responses.create(model=MODEL, input=QUESTION, background=True)
        with pytest.raises(openai.RateLimitError) as info:
            await client.responses.create(model=MODEL, input=QUESTION, background=True)
        await client.responses.cancel(first.id)
        return info.value

    error = asyncio.run(run())
    assert "--responses-max-background" in error.message


def test_input_items_pages(tokenizer):  # noqa: F811
    client, _ = _scripted_client(tokenizer, "Fine.")
    conversation = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                    for i in range(5)]

    async def run() -> tuple[list[Any], list[Any]]:
        response = await client.responses.create(model=MODEL, input=conversation)
        pages = []
        after = None
        while True:
            page = await client.responses.input_items.list(response.id, limit=2, order="asc",
                                                           **({"after": after} if after else {}))
            pages.append(page)
            if not page.has_more:
                return pages, (await client.responses.input_items.list(response.id)).data
            after = page.last_id

    pages, newest_first = asyncio.run(run())
    texts = [item.content[0].text for page in pages for item in page.data]
    assert texts == [f"turn {i}" for i in range(5)] and len(pages) == 3
    assert [item.content[0].text for item in newest_first] == texts[::-1]


def test_item_reference_names_a_stored_item(tokenizer):  # noqa: F811
    client, engine = _scripted_client(tokenizer, "Fine.")

    async def run() -> tuple[Any, Any]:
        first = await client.responses.create(model=MODEL, input="How are you?")
        await client.responses.create(model=MODEL, input=[
            {"type": "item_reference", "id": first.output[0].id},
            {"role": "user", "content": "Good."}])
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model=MODEL, input=[
                {"type": "item_reference", "id": "msg_gone"}])
        return first, info.value

    first, error = asyncio.run(run())
    assert "<|im_start|>assistant\nFine.<|im_end|>" in engine.calls[-1]["prompt"]["prompt"]
    assert error.body["param"] == "input[0].id" and "msg_gone" in error.message


def test_conversation_becomes_chat_messages():
    from folio.entrypoints.openai.responses_protocol import INPUT_ITEMS
    from folio.entrypoints.openai.responses_requests import chat_messages
    items = INPUT_ITEMS.validate_python([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                     {"type": "input_text", "text": "In Paris."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    ])
    assert chat_messages("Instructions.", items, 0) == [
        {"role": "system", "content": "Instructions."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?\nIn Paris."},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]


# ---- the store ----------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _entry(response_id: str, tokens: tuple[int, ...] = (1, 2, 3)) -> StoredResponse:
    return StoredResponse(response_id, {"id": response_id, "output": []},
                          [{"type": "message", "role": "user", "content": response_id}],
                          array("i", tokens))


def test_store_evicts_the_least_recently_used():
    store = ResponseStore(max_entries=2, ttl_s=60, clock=Clock())
    store.put(_entry("a"))
    store.put(_entry("b"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_entry("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_store_indexes_the_items_of_live_entries():
    store = ResponseStore(max_entries=1, ttl_s=60, clock=Clock())
    first = _entry("a")
    first.input_items = [{"id": "msg_in", "type": "message", "role": "user", "content": "hi"}]
    first.response = {"id": "a", "output": [{"id": "msg_out", "type": "message"}]}
    store.put(first)
    assert store.item("msg_in")["content"] == "hi" and store.item("msg_out") is not None
    store.put(_entry("b"))  # a is evicted, and its items with it
    assert store.item("msg_in") is None and store.item("msg_out") is None


def test_store_expires_after_the_last_use():
    clock = Clock()
    store = ResponseStore(max_entries=8, ttl_s=60, clock=clock)
    store.put(_entry("a"))
    store.put(_entry("b"))
    clock.now += 50
    assert store.get("a") is not None  # used: a's time-to-live starts again
    clock.now += 20
    assert store.get("b") is None and store.get("a") is not None
    clock.now += 61
    assert store.get("a") is None and len(store) == 0


def test_store_file_survives_a_restart(tmp_path):
    path = str(tmp_path / "responses.sqlite")
    clock = Clock()
    store = ResponseStore(max_entries=8, ttl_s=60, path=path, clock=clock)
    for name in ("a", "b", "c"):
        store.put(_entry(name, tokens=(7, 8, 2 ** 31 - 1)))
        clock.now += 1
    assert store.delete("b") and not store.delete("b")
    store.close()
    reopened = ResponseStore(max_entries=8, ttl_s=60, path=path, clock=clock)
    a = reopened.get("a")
    assert a is not None and a.response == {"id": "a", "output": []}
    assert a.input_items == _entry("a").input_items and list(a.token_ids) == [7, 8, 2 ** 31 - 1]
    assert reopened.get("b") is None
    clock.now += 1
    assert reopened.get("c") is not None  # now the most recently used
    reopened.close()
    # Reopened with a smaller bound, the most recently used are kept; expired ones are gone.
    smaller = ResponseStore(max_entries=1, ttl_s=60, path=path, clock=clock)
    assert len(smaller) == 1 and smaller.get("c") is not None
    smaller.close()
    clock.now += 61
    expired = ResponseStore(max_entries=8, ttl_s=60, path=path, clock=clock)
    assert len(expired) == 0
    expired.close()


def test_store_flags():
    import argparse
    from folio.entrypoints.openai.cli_args import add_serve_args
    from folio.entrypoints.openai.responses_store import ResponsesConfig
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = ResponsesConfig.from_args(parser.parse_args([
        "--responses-store-max-entries", "10", "--responses-store-ttl", "30",
        "--responses-store-path", "/tmp/r.sqlite", "--responses-max-background", "2"]))
    assert config == ResponsesConfig(10, 30.0, "/tmp/r.sqlite", 2)
    with pytest.raises(ValueError, match="--responses-store-max-entries"):
        ResponsesConfig(store_max_entries=0)
