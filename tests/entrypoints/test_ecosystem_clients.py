"""Ecosystem clients against a real `folio serve`: LangChain's ChatOpenAI (langchain-openai)
and LiteLLM, as people point them at an OpenAI-compatible server.

One server of the default model (SmolLM2-135M-Instruct, float32) with the real Qwen3 chat
template (tools, tool results; fetched by fixtures_tokenizers) and the hermes tool-call parser,
behind an API key. The model is small, so the assertions are about what the server guarantees,
never about the model's judgement:

* greedy (temperature 0) answers through a client equal the openai SDK's answer to the same
  request, streamed or not, sync or async: the client's request reached the server intact and
  its parse of the reply is complete;
* forced tool calls (a named tool, "required"/"any") and structured output are shaped by a
  grammar, so their arguments always validate against the schema;
* a tool round trip (assistant tool_calls -> tool result -> answer) is accepted and rendered as
  the SDK's request is;
* the API key is sent, and a wrong one raises the client's authentication error.

LiteLLM fetches its model cost map from the internet at import unless
LITELLM_LOCAL_MODEL_COST_MAP is true: it is set before the import, so the module runs offline.
LangChain's tracing (LangSmith) is off unless its environment variables turn it on; they are
cleared for the module. litellm.embedding has no generative-model answer: here it must get the
server's clean 400, and against an embedding app (in process, a stand-in pooling engine) it
must work, which it did not while folio refused the `"encoding_format": null` LiteLLM sends.

The server runs with OMP_NUM_THREADS=1 (see test_structured_server.py).
"""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Literal

# Before litellm is imported anywhere: the packaged cost map, never a download.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import litellm  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage, HumanMessage, SystemMessage, ToolMessage)
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from server_utils import RemoteServer, qwen3_chat_template_file  # noqa: E402

API_KEY = "ecosystem-test-key"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
SDK_QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
WEATHER_QUESTION = "What is the weather in Paris?"
MAX_TOKENS = 24
TOOL_MAX_TOKENS = 64  # room for a grammar-shaped call, whitespace included

litellm.suppress_debug_info = True  # no "Give Feedback" banners on the errors the tests expect

# The clients' own warnings, not the server's: langchain-core serializes a parsed structured
# output into a field typed None, and LiteLLM's stream builder reads pydantic's deprecated
# instance attributes.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince211"),
]


class GetWeather(BaseModel):
    """Get the current weather in a city"""

    city: str = Field(description="The city name")
    unit: Literal["celsius", "fahrenheit"]


class CityFacts(BaseModel):
    """Facts about a city"""

    city: str
    country: str
    population: int


WEATHER_TOOL = convert_to_openai_tool(GetWeather)
WEATHER_SCHEMA = WEATHER_TOOL["function"]["parameters"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = qwen3_chat_template_file(tmp_path_factory.mktemp("ecosystem"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = RemoteServer(["--max-model-len", "2048", "--num-gpu-blocks-override", "256",
                            "--dtype", "float32", "--max-num-seqs", "16",
                            "--chat-template", template,
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                           api_key=API_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module", autouse=True)
def _no_tracing():
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return server.client(timeout=120)


def _chat_model(server, **kwargs: Any) -> ChatOpenAI:
    kwargs.setdefault("api_key", API_KEY)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", max_retries=0, timeout=120,
                      **kwargs)


@pytest.fixture(scope="module")
def llm(server) -> ChatOpenAI:
    return _chat_model(server)


def _sdk_chat(sdk: openai.OpenAI, messages: list[dict], **kwargs: Any):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def _lc_messages() -> list:
    return [SystemMessage(SYSTEM), HumanMessage(QUESTION)]


def _concat(chunks: list) -> Any:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def _valid_weather(args: dict) -> None:
    jsonschema.validate(args, WEATHER_SCHEMA)
    GetWeather.model_validate(args)


# ---- LangChain: ChatOpenAI ---------------------------------------------------------------

def test_langchain_invoke_matches_the_openai_sdk(llm, sdk):
    message = llm.invoke(_lc_messages())
    reference = _sdk_chat(sdk, SDK_QUESTION)
    assert isinstance(message, AIMessage)
    assert message.content == reference.choices[0].message.content
    assert "Paris" in message.content
    assert message.tool_calls == [] and message.invalid_tool_calls == []
    meta = message.response_metadata
    assert meta["finish_reason"] == reference.choices[0].finish_reason == "stop"
    assert meta["model_name"] == MODEL and meta["id"].startswith("chatcmpl-")
    usage = message.usage_metadata
    assert usage["input_tokens"] == reference.usage.prompt_tokens
    assert usage["output_tokens"] == reference.usage.completion_tokens
    assert usage["total_tokens"] == reference.usage.total_tokens


def test_langchain_max_tokens_reaches_the_server(server):
    # ChatOpenAI sends max_tokens as OpenAI's newer max_completion_tokens.
    message = _chat_model(server, max_tokens=3).invoke(_lc_messages())
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == 3


def test_langchain_stream_concatenates_to_invoke(llm):
    message = llm.invoke(_lc_messages())
    chunks = list(llm.stream(_lc_messages(), stream_usage=True))
    assert len(chunks) > 2
    streamed = _concat(chunks)
    assert "".join(c.content for c in chunks) == streamed.content == message.content
    assert streamed.response_metadata["finish_reason"] == "stop"
    assert streamed.response_metadata["model_name"] == MODEL
    # stream_options.include_usage: the usage chunk is parsed into usage_metadata.
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert streamed.usage_metadata[key] == message.usage_metadata[key]


def test_langchain_stop_and_logprobs(llm, sdk):
    message = llm.bind(logprobs=True, top_logprobs=2).invoke(_lc_messages(), stop=[" is "])
    reference = _sdk_chat(sdk, SDK_QUESTION, stop=[" is "])
    assert message.content == reference.choices[0].message.content
    assert " is " not in message.content
    tokens = message.response_metadata["logprobs"]["content"]
    # The tokens that completed the stop string are generated tokens too: they keep their
    # logprobs while the text stops before the match.
    assert "".join(t["token"] for t in tokens).startswith(message.content + " is")
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in tokens)


def test_langchain_async_invoke_and_stream(llm):
    sync = llm.invoke(_lc_messages())

    async def run():
        message = await llm.ainvoke(_lc_messages())
        chunks = [chunk async for chunk in llm.astream(_lc_messages())]
        batch = await llm.abatch([_lc_messages(), _lc_messages()])
        return message, chunks, batch

    message, chunks, batch = asyncio.run(run())
    assert message.content == sync.content
    assert "".join(c.content for c in chunks) == sync.content
    assert [m.content for m in batch] == [sync.content] * 2


@pytest.mark.parametrize("tool_choice", ["GetWeather", "any", "required"])
def test_langchain_bind_tools_forced_calls_validate(server, tool_choice):
    llm = _chat_model(server, max_tokens=TOOL_MAX_TOKENS)
    bound = llm.bind_tools([GetWeather], tool_choice=tool_choice, parallel_tool_calls=False)
    message = bound.invoke(WEATHER_QUESTION)
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    _valid_weather(call["args"])
    # Streamed, the chunks' tool_call_chunks merge into the same call.
    streamed = _concat(list(bound.stream(WEATHER_QUESTION)))
    assert streamed.invalid_tool_calls == []
    [streamed_call] = streamed.tool_calls
    assert streamed_call["name"] == "GetWeather" and streamed_call["args"] == call["args"]
    assert streamed_call["id"].startswith("call_")


@pytest.mark.parametrize("method, strict", [("json_schema", None), ("json_schema", True),
                                            ("function_calling", None)])
def test_langchain_structured_output(server, method, strict):
    llm = _chat_model(server, max_tokens=TOOL_MAX_TOKENS)
    structured = llm.with_structured_output(CityFacts, method=method, strict=strict,
                                            include_raw=True)
    result = structured.invoke("Describe Paris: its name, country and population.")
    assert result["parsing_error"] is None, result["raw"]
    assert isinstance(result["parsed"], CityFacts)
    raw = result["raw"]
    if method == "function_calling":
        [call] = raw.tool_calls
        assert call["name"] == "CityFacts"
        assert CityFacts.model_validate(call["args"]) == result["parsed"]
    else:
        assert CityFacts.model_validate_json(raw.content) == result["parsed"]
    # Streamed, the last parsed object is the same one.
    plain = llm.with_structured_output(CityFacts, method=method, strict=strict)
    streamed = list(plain.stream("Describe Paris: its name, country and population."))
    assert streamed and streamed[-1] == result["parsed"]


def test_langchain_tool_round_trip(server, sdk):
    llm = _chat_model(server, max_tokens=TOOL_MAX_TOKENS)
    call_message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke(
        WEATHER_QUESTION)
    [call] = call_message.tool_calls
    result = '{"temperature": 22, "sky": "sunny"}'
    history = [HumanMessage(WEATHER_QUESTION), call_message,
               ToolMessage(content=result, tool_call_id=call["id"])]
    answer = _chat_model(server).bind_tools([GetWeather]).invoke(history)
    assert isinstance(answer, AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    # The server read the conversation as the SDK's spelling of it: same prompt, same answer.
    reference = _sdk_chat(sdk, [
        {"role": "user", "content": WEATHER_QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["args"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": result}],
        tools=[WEATHER_TOOL])
    assert answer.usage_metadata["input_tokens"] == reference.usage.prompt_tokens
    assert answer.content == (reference.choices[0].message.content or "")
    # The result reached the prompt: a longer result is a longer prompt.
    longer = _chat_model(server, max_tokens=1).bind_tools([GetWeather]).invoke(
        [*history[:2], ToolMessage(content=result + " and a light wind from the west",
                                   tool_call_id=call["id"])])
    assert longer.usage_metadata["input_tokens"] > answer.usage_metadata["input_tokens"]


def test_langchain_sends_the_api_key_and_a_wrong_key_raises(server):
    seen: list[str | None] = []
    http = httpx.Client(event_hooks={"request": [
        lambda request: seen.append(request.headers.get("authorization"))]}, timeout=120)
    with http:
        _chat_model(server, max_tokens=2, http_client=http).invoke(QUESTION)
    assert seen == [f"Bearer {API_KEY}"]
    with pytest.raises(openai.AuthenticationError) as excinfo:
        _chat_model(server, api_key="not-the-key", max_tokens=2).invoke(QUESTION)
    assert excinfo.value.status_code == 401


# ---- LiteLLM -----------------------------------------------------------------------------

def _litellm_kwargs(server, provider: str = "openai", **kwargs: Any) -> dict:
    return dict(model=f"{provider}/{MODEL}", api_base=server.url + "/v1", api_key=API_KEY,
                temperature=0, max_retries=0, timeout=120, **kwargs)


def _tool_calls_of(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    return calls


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_completion_matches_the_openai_sdk(server, sdk, provider):
    response = litellm.completion(**_litellm_kwargs(server, provider), messages=SDK_QUESTION,
                                  max_tokens=MAX_TOKENS)
    reference = _sdk_chat(sdk, SDK_QUESTION)
    [choice] = response.choices
    assert choice.message.content == reference.choices[0].message.content
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert response.id.startswith("chatcmpl-")
    assert response.usage.prompt_tokens == reference.usage.prompt_tokens
    assert response.usage.completion_tokens == reference.usage.completion_tokens


def test_litellm_streaming_matches_the_openai_sdk(server, sdk):
    chunks = list(litellm.completion(**_litellm_kwargs(server), messages=SDK_QUESTION,
                                     max_tokens=MAX_TOKENS, stream=True,
                                     stream_options={"include_usage": True}))
    reference = _sdk_chat(sdk, SDK_QUESTION)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content
    assert [c.usage for c in chunks if getattr(c, "usage", None)][-1].completion_tokens == \
        reference.usage.completion_tokens
    rebuilt = litellm.stream_chunk_builder(chunks, messages=SDK_QUESTION)
    assert rebuilt.choices[0].message.content == text
    assert rebuilt.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "GetWeather"}}, "required"])
@pytest.mark.parametrize("stream", [False, True])
def test_litellm_forced_tool_calls_validate(server, tool_choice, stream):
    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    response = litellm.completion(**_litellm_kwargs(server), messages=messages,
                                  tools=[WEATHER_TOOL], tool_choice=tool_choice,
                                  parallel_tool_calls=False, max_tokens=TOOL_MAX_TOKENS,
                                  stream=stream)
    if stream:
        response = litellm.stream_chunk_builder(list(response), messages=messages)
    [(name, args)] = _tool_calls_of(response.choices[0].message)
    assert name == "GetWeather"
    _valid_weather(args)


def test_litellm_response_format_json_schema(server):
    response = litellm.completion(
        **_litellm_kwargs(server), max_tokens=TOOL_MAX_TOKENS, response_format=CityFacts,
        messages=[{"role": "user", "content": "Describe Paris: its name, country and "
                                              "population."}])
    CityFacts.model_validate_json(response.choices[0].message.content)


def test_litellm_tool_round_trip(server, sdk):
    messages: list[dict] = [{"role": "user", "content": WEATHER_QUESTION}]
    forced = {"type": "function", "function": {"name": "GetWeather"}}
    call_message = litellm.completion(**_litellm_kwargs(server), messages=messages,
                                      tools=[WEATHER_TOOL], tool_choice=forced,
                                      max_tokens=TOOL_MAX_TOKENS).choices[0].message
    [call] = call_message.tool_calls
    # LiteLLM's message goes back as it came (its own extra keys included).
    messages += [call_message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 22}'}]
    answer = litellm.completion(**_litellm_kwargs(server), messages=messages,
                                tools=[WEATHER_TOOL], max_tokens=MAX_TOKENS)
    reference = _sdk_chat(sdk, [messages[0], {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        messages[2]], tools=[WEATHER_TOOL])
    assert answer.usage.prompt_tokens == reference.usage.prompt_tokens
    assert answer.choices[0].message.content == reference.choices[0].message.content


def test_litellm_async_completion_and_stream(server, sdk):
    reference = _sdk_chat(sdk, SDK_QUESTION).choices[0].message.content

    async def run():
        response = await litellm.acompletion(**_litellm_kwargs(server), messages=SDK_QUESTION,
                                             max_tokens=MAX_TOKENS)
        stream = await litellm.acompletion(**_litellm_kwargs(server), messages=SDK_QUESTION,
                                           max_tokens=MAX_TOKENS, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return response.choices[0].message.content, text

    assert asyncio.run(run()) == (reference, reference)


def test_litellm_text_completion_matches_the_openai_sdk(server, sdk):
    prompt = "The capital of France is"
    response = litellm.text_completion(**_litellm_kwargs(server), prompt=prompt, max_tokens=8)
    reference = sdk.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert response.choices[0].text == reference.choices[0].text
    assert response.choices[0].finish_reason == reference.choices[0].finish_reason


def test_litellm_wrong_key_raises_its_authentication_error(server):
    kwargs = _litellm_kwargs(server)
    kwargs["api_key"] = "not-the-key"
    with pytest.raises(litellm.AuthenticationError) as excinfo:
        litellm.completion(**kwargs, messages=SDK_QUESTION, max_tokens=2)
    assert excinfo.value.status_code == 401
    assert isinstance(excinfo.value, openai.AuthenticationError)


def test_litellm_embedding_on_a_generative_model_is_a_clean_400(server):
    with pytest.raises(litellm.BadRequestError) as excinfo:
        litellm.embedding(**{k: v for k, v in _litellm_kwargs(server).items()
                             if k != "temperature"}, input=["hello"])
    assert excinfo.value.status_code == 400
    assert "pooling model" in str(excinfo.value)


def test_litellm_embedding_against_an_embedding_app():
    """litellm.aembedding against the app of an embedding model, in process (a stand-in
    pooling engine, as test_pooling_app.py's): LiteLLM sends `"encoding_format": null`."""
    from test_pooling_app import API_KEY as POOL_KEY
    from test_pooling_app import EMBED, FakePoolingEngine, _app, _letters, _post

    engine = FakePoolingEngine(EMBED)
    app = _app(engine)
    texts = ["hello world", "cat"]

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=POOL_KEY,
                                    http_client=http, max_retries=0)
        try:
            return await litellm.aembedding(model="openai/m", input=texts, client=client,
                                            api_base="http://test/v1", api_key=POOL_KEY)
        finally:
            await http.aclose()

    response = asyncio.run(run())
    assert [item["index"] for item in response.data] == [0, 1]
    for item, text in zip(response.data, texts):
        expected = _letters(text) / np.linalg.norm(_letters(text))
        np.testing.assert_allclose(item["embedding"], expected, rtol=1e-6)
    # The wire-level form of it: an explicit null is the default format, floats.
    raw = _post(app, "/v1/embeddings", {"model": "m", "input": "cat", "encoding_format": None})
    assert raw.status_code == 200, raw.text
    assert isinstance(raw.json()["data"][0]["embedding"], list)
