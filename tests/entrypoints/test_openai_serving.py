"""The OpenAI handlers (folio.entrypoints.openai) against a scripted fake engine: request
validation, request -> SamplingParams, response and SSE shapes. No model, no HTTP server."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator

import pydantic
import pytest

from folio.engine.async_llm import EngineDeadError
from folio.entrypoints.openai.errors import OpenAIError, validation_error_to_openai
from folio.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.entrypoints.openai.serving_completion import OpenAIServingCompletion
from folio.request_outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import RequestOutputKind, SamplingParams

MODEL = "smol"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    from folio.model.default_model import default_model_path
    try:
        path = default_model_path()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"default model unavailable (make test installs it): {exc}")
    return transformers.AutoTokenizer.from_pretrained(path)


class FakeEngine:
    """Stands in for AsyncLLM: each child j of a request generates `texts[j % len]`,
    `tokens_per_step` tokens a step (1; more, as speculative decoding's kept drafts come), with
    scripted logprobs (the sampled token is rank 1 at -0.5, the
    k alternatives are the next ids at -1.5, -2.5, ...)."""

    def __init__(self, tokenizer: Any, *, max_model_len: int = 256,
                 texts: tuple[str, ...] = (" Hello there, friend!",),
                 finish_reason: str = "stop", num_cached_tokens: int = 3,
                 step_delay_s: float = 0.0, defaults: SamplingParams | None = None,
                 tokens_per_step: int = 1) -> None:
        self.tokenizer = tokenizer
        self.tokens_per_step = tokens_per_step
        self.max_model_len = max_model_len
        self.texts = texts
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.step_delay_s = step_delay_s
        self.defaults = defaults or SamplingParams()
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.raise_on_generate: BaseException | None = None
        self.raise_mid_stream: BaseException | None = None
        # KV pins the server ended (the Responses store's deletions).
        self.unpinned: list[str] = []

    def default_sampling_params(self) -> SamplingParams:
        return self.defaults.clone()

    def _position(self, tid: int, k: int, lp: float = -0.5) -> dict[int, Logprob]:
        pos = {tid: Logprob(lp, 1, self.tokenizer.decode([tid]))}
        for r in range(k):
            alt = tid + r + 1
            pos[alt] = Logprob(lp - 1.0 - r, r + 2, self.tokenizer.decode([alt]))
        return pos

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       kv_pin_ttl: float | None = None) -> AsyncIterator[RequestOutput]:
        self.calls.append({"prompt": prompt, "params": params, "request_id": request_id,
                           "priority": priority, "cache_salt": cache_salt,
                           "kv_pin_ttl": kv_pin_ttl})
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        prompt_ids = list(prompt["prompt_token_ids"])
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._position(t, params.prompt_logprobs, -1.0)
                                        for t in prompt_ids[1:]]
        scripts = []
        for j in range(params.n):
            ids = self.tokenizer.encode(self.texts[j % len(self.texts)], add_special_tokens=False)
            scripts.append(ids[:params.max_tokens])
        per_step = self.tokens_per_step
        steps = -(-max(len(s) for s in scripts) // per_step)
        sent = [0] * params.n
        finished = False
        try:
            for step in range(steps):
                await asyncio.sleep(self.step_delay_s)
                if self.raise_mid_stream is not None and step == 1:
                    raise self.raise_mid_stream
                last = step == steps - 1
                if params.output_kind != RequestOutputKind.DELTA and not last:
                    continue
                outputs = []
                for j, ids in enumerate(scripts):
                    start = sent[j] if params.output_kind == RequestOutputKind.DELTA else 0
                    end = min((step + 1) * per_step, len(ids))
                    if params.output_kind == RequestOutputKind.DELTA and end == sent[j]:
                        continue
                    new = ids[start:end]
                    sent[j] = end
                    done = end == len(ids)
                    reason = None
                    if done:
                        reason = "length" if len(ids) == params.max_tokens else self.finish_reason
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = [self._position(t, params.logprobs) for t in new]
                    outputs.append(CompletionOutput(
                        index=j, text=self.tokenizer.decode(new), token_ids=new,
                        cumulative_logprob=-0.5 * end, logprobs=logprobs,
                        finish_reason=reason, stop_reason=None))
                finished = last
                yield RequestOutput(request_id=request_id, prompt=prompt.get("prompt"),
                                    prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs,
                                    outputs=outputs, finished=last,
                                    num_cached_tokens=self.num_cached_tokens)
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def unpin_kv(self, request_ids: list[str]) -> int:
        self.unpinned += request_ids
        return len(request_ids)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def completion(engine: FakeEngine, is_disconnected=None, **fields: Any) -> Any:
    fields.setdefault("model", MODEL)
    fields.setdefault("prompt", "Once upon a time")
    handler = OpenAIServingCompletion(engine, [MODEL, "alias"])
    handler.disconnect_poll_interval_s = 0.01
    request = CompletionRequest.model_validate(fields)
    return run(_resolve(handler.create_completion(request, request_id="cmpl-test",
                                                  is_disconnected=is_disconnected)))


def chat(engine: FakeEngine, is_disconnected=None, **fields: Any) -> Any:
    fields.setdefault("model", MODEL)
    fields.setdefault("messages", MESSAGES)
    handler = OpenAIServingChat(engine, [MODEL])
    handler.disconnect_poll_interval_s = 0.01
    request = ChatCompletionRequest.model_validate(fields)
    return run(_resolve(handler.create_chat_completion(request, request_id="abc",
                                                       is_disconnected=is_disconnected)))


async def _resolve(coro: Any) -> Any:
    """Await the handler; drain a stream into a list of SSE strings in the same loop."""
    result = await coro
    if hasattr(result, "__aiter__"):
        return [event async for event in result]
    return result


def events(sse: list[str]) -> list[Any]:
    """SSE strings -> parsed JSON payloads (the final [DONE] as the string "[DONE]")."""
    out = []
    for event in sse:
        assert event.startswith("data: ") and event.endswith("\n\n"), event
        body = event[len("data: "):-2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


def error_of(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------
# request -> SamplingParams
# ---------------------------------------------------------------------------------------


def test_completion_fields_map_to_sampling_params(tokenizer):
    engine = FakeEngine(tokenizer)
    completion(engine, temperature=0.7, top_p=0.9, n=2, best_of=2, max_tokens=5, stop=["\n"],
               presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": 5.0}, seed=7,
               user="u1", top_k=20, min_p=0.05, repetition_penalty=1.1, min_tokens=2,
               ignore_eos=True, stop_token_ids=[2], include_stop_str_in_output=True,
               skip_special_tokens=False, spaces_between_special_tokens=False,
               prompt_logprobs=2, truncate_prompt_tokens=50, allowed_token_ids=[1, 2, 3],
               bad_words=["bad"], cache_salt="salt", priority=3, logprobs=3,
               unknown_extra_field="ignored")
    [call] = engine.calls
    p: SamplingParams = call["params"]
    assert (p.temperature, p.top_p, p.n, p.max_tokens) == (0.7, 0.9, 2, 5)
    assert p.stop == ["\n"] and p.presence_penalty == 0.5 and p.frequency_penalty == -0.5
    assert p.logit_bias == {42: 5.0} and p.seed == 7
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (20, 0.05, 1.1, 2)
    assert p.ignore_eos and p.stop_token_ids == [2] and p.include_stop_str_in_output
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
    assert p.prompt_logprobs == 2 and p.truncate_prompt_tokens == 50 and p.logprobs == 3
    assert p.allowed_token_ids == [1, 2, 3] and p.bad_words == ["bad"]
    assert p.output_kind == RequestOutputKind.FINAL_ONLY
    assert call["priority"] == 3 and call["cache_salt"] == "salt"
    assert call["request_id"] == "cmpl-test"
    assert call["prompt"]["prompt_token_ids"] == tokenizer.encode("Once upon a time")


def test_omitted_fields_use_engine_defaults(tokenizer):
    engine = FakeEngine(tokenizer, defaults=SamplingParams(temperature=0.6, top_p=0.95,
                                                           top_k=30, repetition_penalty=1.05))
    chat(engine)
    p = engine.calls[0]["params"]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 30, 1.05)
    chat(engine, temperature=0.2)
    assert engine.calls[1]["params"].temperature == 0.2
    assert engine.calls[1]["params"].top_k == 30


def test_chat_fields_and_max_tokens(tokenizer):
    engine = FakeEngine(tokenizer)
    chat(engine, max_tokens=7, temperature=0.5, logprobs=True, top_logprobs=4, stream=True,
         stream_options={"include_usage": True})
    p = engine.calls[-1]["params"]
    assert p.max_tokens == 7 and p.logprobs == 4 and p.output_kind == RequestOutputKind.DELTA
    # max_completion_tokens wins over max_tokens
    chat(engine, max_tokens=7, max_completion_tokens=3)
    assert engine.calls[-1]["params"].max_tokens == 3
    # omitted: fill the context
    chat(engine)
    prompt_len = len(engine.calls[-1]["prompt"]["prompt_token_ids"])
    assert engine.calls[-1]["params"].max_tokens == engine.max_model_len - prompt_len
    # logprobs without top_logprobs: only the chosen token
    chat(engine, logprobs=True)
    assert engine.calls[-1]["params"].logprobs == 0
    assert chat(engine).choices[0].logprobs is None


def test_completion_max_tokens_default_and_null(tokenizer):
    engine = FakeEngine(tokenizer)
    completion(engine)
    assert engine.calls[-1]["params"].max_tokens == 16
    completion(engine, max_tokens=None)
    prompt_len = len(engine.calls[-1]["prompt"]["prompt_token_ids"])
    assert engine.calls[-1]["params"].max_tokens == engine.max_model_len - prompt_len


def test_chat_prompt_is_the_rendered_template(tokenizer):
    engine = FakeEngine(tokenizer)
    chat(engine)
    prompt = engine.calls[0]["prompt"]
    assert prompt["prompt"].rstrip().endswith("<|im_start|>assistant")
    assert prompt["prompt_token_ids"] == tokenizer.encode(prompt["prompt"],
                                                          add_special_tokens=False)
    chat(engine, messages=MESSAGES + [{"role": "assistant", "content": "Hel"}],
         add_generation_prompt=False, continue_final_message=True)
    assert engine.calls[1]["prompt"]["prompt"].endswith("Hel")
    chat(engine, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert engine.calls[2]["prompt"]["prompt"] == "[Say hello]"


def test_truncate_prompt_tokens(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=64)
    long_prompt = "word " * 100
    completion(engine, prompt=long_prompt, truncate_prompt_tokens=10, max_tokens=4)
    assert len(engine.calls[0]["prompt"]["prompt_token_ids"]) == 10
    assert engine.calls[0]["prompt"]["prompt_token_ids"] == tokenizer.encode(long_prompt)[-10:]


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"temperature": 0.0, "n": 2}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop": ["a", ""]}, "stop"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_sampling_param_errors_name_the_param(tokenizer, fields, param):
    err = error_of(completion, FakeEngine(tokenizer), **fields)
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert err.param == param, err
    assert err.to_response_body()["error"]["param"] == param


def test_chat_max_completion_tokens_error_names_it(tokenizer):
    err = error_of(chat, FakeEngine(tokenizer), max_completion_tokens=0)
    assert err.param == "max_completion_tokens"


@pytest.mark.parametrize("model,fields,param", [
    (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CompletionRequest, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (CompletionRequest, {"prompt": [1.5]}, "prompt"),
    (CompletionRequest, {}, "prompt"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
    (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": -2}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": MESSAGES, "stop_token_ids": ["a"]},
     "stop_token_ids[0]"),
    (ChatCompletionRequest, {"messages": MESSAGES, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
])
def test_validation_errors_name_the_param(model, fields, param):
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(fields)
    err = validation_error_to_openai(info.value)
    assert err.status_code == 400 and err.param == param, err
    assert param in err.message


def test_validation_error_without_field_and_from_fastapi_shape():
    class FastAPIStyle:  # RequestValidationError-like: locations start with "body"
        def errors(self):
            return [{"type": "greater_than_equal", "loc": ("body", "n"),
                     "msg": "Input should be greater than or equal to 1"}]
    err = validation_error_to_openai(FastAPIStyle())
    assert err.param == "n" and err.status_code == 400

    class BadJSON:
        def errors(self):
            return [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error"}]
    err = validation_error_to_openai(BadJSON())
    assert err.param is None and "not valid JSON" in err.message


def test_context_length_errors(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=32)
    err = error_of(completion, engine, prompt="word " * 40)
    assert err.status_code == 400 and err.code == "context_length_exceeded"
    assert "maximum context length is 32 tokens" in err.message
    # More than the whole context: no prompt could leave that room.
    err = error_of(completion, engine, prompt="Hi there", max_tokens=33)
    assert err.param == "max_tokens" and err.code == "context_length_exceeded"
    assert "at most the model's maximum context length of 32" in err.message
    assert not engine.calls  # nothing reached the engine
    # Within the context but past the prompt's room: clamped to the room (vLLM's rule).
    prompt_len = len(tokenizer.encode("Hi there"))
    completion(engine, prompt="Hi there", max_tokens=31)
    assert engine.calls[-1]["params"].max_tokens == 32 - prompt_len
    chat(FakeEngine(tokenizer))
    chat_len = len(engine_prompt_ids := FakeEngine(tokenizer).tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False))
    assert engine_prompt_ids
    engine = FakeEngine(tokenizer, max_model_len=chat_len + 5)
    err = error_of(chat, engine, max_completion_tokens=chat_len + 6)
    assert err.param == "max_completion_tokens"
    err = error_of(chat, engine, max_tokens=chat_len + 6)
    assert err.param == "max_tokens"
    chat(engine, max_tokens=10)
    assert engine.calls[-1]["params"].max_tokens == 5
    engine.calls.clear()
    err = error_of(chat, FakeEngine(tokenizer, max_model_len=chat_len))
    assert err.param == "messages" and f"has {chat_len} input tokens" in err.message
    assert not engine.calls


def test_model_not_found(tokenizer):
    engine = FakeEngine(tokenizer)
    err = error_of(chat, engine, model="gpt-4")
    assert err.status_code == 404 and err.type == "NotFoundError"
    assert err.code == 404 and err.param == "model"  # vLLM's body
    assert completion(engine, model="alias").model == "alias"
    assert completion(engine, model=None).model == MODEL
    assert chat(engine, model="").model == MODEL


@pytest.mark.parametrize("call,fields,param,text", [
    ("completion", {"suffix": "end"}, "suffix", "suffix is not supported"),
    ("completion", {"best_of": 3}, "best_of", "best_of"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema", "must be an object"),
    ("completion", {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs", "exactly one of"),
    ("completion", {"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown"),
    ("chat", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    # Without --enable-auto-tool-choice and a parser, tools cannot be honoured: refused.
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "--enable-auto-tool-choice"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages",
     "not supported"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ("chat", {"continue_final_message": True, "messages": MESSAGES}, "add_generation_prompt",
     "continue_final_message"),
])
def test_unsupported_and_bad_input_400(tokenizer, call, fields, param, text):
    engine = FakeEngine(tokenizer)
    err = error_of(completion if call == "completion" else chat, engine, **fields)
    assert err.status_code == 400 and err.param == param, err
    assert text in err.message
    assert not engine.calls


def test_text_response_format_and_tool_choice_none_are_accepted(tokenizer):
    engine = FakeEngine(tokenizer)
    out = chat(engine, response_format={"type": "text"}, tool_choice="none")
    assert isinstance(out, ChatCompletionResponse)


def test_engine_value_error_is_400(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.raise_on_generate = ValueError("allowed_token_ids contains token ids outside the "
                                          "vocabulary [0, 49152): [99999]")
    err = error_of(completion, engine)
    assert err.status_code == 400 and err.param == "allowed_token_ids"
    err = error_of(chat, engine, stream=True)
    assert err.status_code == 400 and "vocabulary" in err.message
    engine.raise_on_generate = ValueError("prompt_token_ids has ids outside the vocabulary")
    assert error_of(completion, engine, prompt=[10**9]).param == "prompt"
    assert error_of(chat, engine).param == "messages"


def test_engine_dead_is_503(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.raise_on_generate = EngineDeadError("the engine core exited (code 1)")
    for fn in (chat, completion):
        for stream in (False, True):
            err = error_of(fn, engine, stream=stream)
            assert err.status_code == 503 and err.type == "ServiceUnavailableError"
            assert err.to_response_body()["error"]["type"] == "ServiceUnavailableError"


def test_error_after_stream_started_is_an_event(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.raise_mid_stream = EngineDeadError("boom")
    out = events(chat(engine, stream=True))
    assert out[-1] == "[DONE]"
    assert out[-2]["error"]["type"] == "ServiceUnavailableError"
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    out = events(completion(engine, stream=True))
    assert out[-1] == "[DONE]" and "boom" in out[-2]["error"]["message"]


# ---------------------------------------------------------------------------------------
# non-streaming responses
# ---------------------------------------------------------------------------------------


def test_chat_response_shape(tokenizer):
    engine = FakeEngine(tokenizer, texts=("Hi!",), num_cached_tokens=5)
    out = chat(engine)
    body = out.model_dump(mode="json")
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    assert body["model"] == MODEL and body["system_fingerprint"] == "folio-0.1.0"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi!"},
                                "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None}]
    prompt_len = len(engine.calls[0]["prompt"]["prompt_token_ids"])
    n_out = len(tokenizer.encode("Hi!", add_special_tokens=False))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": n_out,
                             "total_tokens": prompt_len + n_out,
                             "prompt_tokens_details": {"cached_tokens": 5}}
    assert "prompt_token_ids" not in body


def test_chat_n2_and_return_token_ids(tokenizer):
    engine = FakeEngine(tokenizer, texts=("One", "Two words"))
    out = chat(engine, n=2, return_token_ids=True).model_dump(mode="json")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in out["choices"]] == ["One", "Two words"]
    assert out["choices"][1]["token_ids"] == tokenizer.encode("Two words",
                                                               add_special_tokens=False)
    assert out["prompt_token_ids"] == engine.calls[0]["prompt"]["prompt_token_ids"]
    assert out["usage"]["completion_tokens"] == 1 + 2


def test_chat_logprobs_format(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" Hello there",))
    out = chat(engine, logprobs=True, top_logprobs=2).model_dump(mode="json")
    content = out["choices"][0]["logprobs"]["content"]
    ids = tokenizer.encode(" Hello there", add_special_tokens=False)
    assert len(content) == len(ids)
    first = content[0]
    token = tokenizer.decode([ids[0]])
    assert first["token"] == token and first["logprob"] == -0.5
    assert first["bytes"] == list(token.encode("utf-8"))
    assert [t["token"] for t in first["top_logprobs"]] == [token, tokenizer.decode([ids[0] + 1])]
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.5]
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    out = chat(engine, logprobs=True).model_dump(mode="json")
    assert out["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_completion_response_shape_and_multiple_prompts(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" A", " B C"), num_cached_tokens=2)
    prompts = ["First prompt", [1, 2, 3]]
    out = completion(engine, prompt=prompts, n=2, temperature=1.0).model_dump(mode="json")
    assert out["id"] == "cmpl-test" and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [" A", " B C", " A", " B C"]
    assert set(out["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                      "stop_reason"}
    assert [call["request_id"] for call in engine.calls] == ["cmpl-test-0", "cmpl-test-1"]
    assert engine.calls[1]["prompt"]["prompt_token_ids"] == [1, 2, 3]
    prompt_tokens = len(tokenizer.encode("First prompt")) + 3
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == 2 * (1 + 2)
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    # a list of token-id lists is several prompts, a flat id list is one
    completion(engine, prompt=[[5, 6], [7, 8]])
    assert [c["prompt"]["prompt_token_ids"] for c in engine.calls[-2:]] == [[5, 6], [7, 8]]


def test_completion_finish_reason_length(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" one two three four five",))
    out = completion(engine, max_tokens=2)
    assert isinstance(out, CompletionResponse)
    assert out.choices[0].finish_reason == "length"
    assert len(tokenizer.encode(out.choices[0].text, add_special_tokens=False)) == 2


def test_completion_legacy_logprobs(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" Hello there",))
    out = completion(engine, logprobs=2).model_dump(mode="json")
    lp = out["choices"][0]["logprobs"]
    ids = tokenizer.encode(" Hello there", add_special_tokens=False)
    tokens = [tokenizer.decode([t]) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [-0.5] * len(ids)
    assert lp["text_offset"] == [0, len(tokens[0])]
    assert lp["top_logprobs"][0] == {tokens[0]: -0.5, tokenizer.decode([ids[0] + 1]): -1.5}
    # logprobs=0: just the chosen token
    out = completion(engine, logprobs=0).model_dump(mode="json")
    assert out["choices"][0]["logprobs"]["top_logprobs"][0] == {tokens[0]: -0.5}


def test_completion_echo(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" there",))
    out = completion(engine, prompt="Hello", echo=True)
    assert out.choices[0].text == "Hello there"
    # echo + logprobs: the prompt tokens come first, the first one without a logprob
    out = completion(engine, prompt="Hello world", echo=True, logprobs=1).model_dump()
    assert engine.calls[-1]["params"].prompt_logprobs == 1
    lp = out["choices"][0]["logprobs"]
    prompt_ids = tokenizer.encode("Hello world")
    assert lp["tokens"][:len(prompt_ids)] == [tokenizer.decode([t]) for t in prompt_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-1.0] * (len(prompt_ids) - 1) + [-0.5]
    assert lp["text_offset"] == [0, len("Hello"), len("Hello world")]
    # token-id prompts echo their decoded text
    out = completion(engine, prompt=tokenizer.encode("Hi"), echo=True)
    assert out.choices[0].text == "Hi there"


def test_completion_return_token_ids_and_prompt_logprobs(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" there",))
    out = completion(engine, prompt="Hello", return_token_ids=True,
                     prompt_logprobs=0).model_dump(mode="json")
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("Hello")
    assert choice["token_ids"] == tokenizer.encode(" there", add_special_tokens=False)
    assert choice["prompt_logprobs"][0] is None


# ---------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------


def test_chat_stream_chunk_sequence(tokenizer):
    text = " Hello there, friend!"
    engine = FakeEngine(tokenizer, texts=(text,), num_cached_tokens=4)
    out = events(chat(engine, stream=True, stream_options={"include_usage": True}))
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    assert all(c["id"] == "chatcmpl-abc" and c["object"] == "chat.completion.chunk"
               for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None,
                                     "stop_reason": None}]
    content = chunks[1:-2]
    assert len(content) == len(tokenizer.encode(text, add_special_tokens=False))
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == text
    assert all("usage" not in c for c in chunks[:-1])
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(content)
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert engine.calls[0]["params"].output_kind == RequestOutputKind.DELTA


def test_chat_stream_n2_continuous_usage_and_logprobs(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" A B", " C"))
    out = events(chat(engine, stream=True, n=2, logprobs=True, top_logprobs=1,
                      stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = out[:-1]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all("usage" in c for c in chunks)
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks[2:-1]:
        choice = c["choices"][0]
        by_index[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
        elif choice["delta"].get("content"):
            assert choice["logprobs"]["content"][0]["logprob"] == -0.5
            assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 1
    assert by_index == {0: " A B", 1: " C"}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_stream_without_usage(tokenizer):
    out = events(chat(FakeEngine(tokenizer), stream=True))
    assert out[-1] == "[DONE]"
    assert out[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in out[:-1])


def test_completion_stream_chunk_sequence(tokenizer):
    text = " Hello there"
    engine = FakeEngine(tokenizer, texts=(text,))
    out = events(completion(engine, prompt="Say", stream=True, echo=True, logprobs=0,
                            return_token_ids=True, stream_options={"include_usage": True}))
    assert out[-1] == "[DONE]"
    chunks = out[:-2]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-test" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Say" + text
    assert chunks[0]["choices"][0]["text"].startswith("Say")
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode("Say")
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    token_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert token_ids == tokenizer.encode(text, add_special_tokens=False)
    usage = out[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(token_ids)


def test_completion_stream_multiple_prompts_n2(tokenizer):
    engine = FakeEngine(tokenizer, texts=(" x", " y z"))
    out = events(completion(engine, prompt=["a", "b"], n=2, stream=True))
    text: dict[int, str] = {}
    for c in out[:-1]:
        choice = c["choices"][0]
        text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert text == {0: " x", 1: " y z", 2: " x", 3: " y z"}


# ---------------------------------------------------------------------------------------
# disconnects
# ---------------------------------------------------------------------------------------


async def _gone() -> bool:
    return True


async def _here() -> bool:
    return False


def test_disconnect_aborts_non_streaming(tokenizer):
    for fn in (chat, completion):
        engine = FakeEngine(tokenizer, step_delay_s=0.05, texts=("word " * 40,))
        err = error_of(fn, engine, is_disconnected=_gone, max_tokens=40)
        assert err.status_code == 499
        assert engine.aborted == [engine.calls[0]["request_id"]]


def test_connected_client_is_not_aborted(tokenizer):
    engine = FakeEngine(tokenizer, step_delay_s=0.005)
    out = chat(engine, is_disconnected=_here)
    assert isinstance(out, ChatCompletionResponse) and not engine.aborted


def test_closing_the_stream_aborts(tokenizer):
    engine = FakeEngine(tokenizer, step_delay_s=0.01, texts=("word " * 40,))
    handler = OpenAIServingChat(engine, [MODEL])

    async def main() -> list[str]:
        stream = await handler.create_chat_completion(
            ChatCompletionRequest(messages=MESSAGES, stream=True, max_tokens=40),
            request_id="x")
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # what the server does when the client goes away
        return got

    got = run(main())
    assert len(got) == 3
    assert engine.aborted == ["chatcmpl-x"]


def test_stream_disconnect_detected_by_poll(tokenizer):
    engine = FakeEngine(tokenizer, step_delay_s=0.02, texts=("word " * 40,))
    calls = 0

    async def gone_later() -> bool:  # connected for the first few polls
        nonlocal calls
        calls += 1
        return calls > 10

    out = events(completion(engine, is_disconnected=gone_later, stream=True, max_tokens=40))
    assert out[-1] == "[DONE]"
    assert 1 < len(out) < 40
    assert engine.aborted == ["cmpl-test"]


def test_disconnect_before_first_output_is_an_error(tokenizer):
    engine = FakeEngine(tokenizer, step_delay_s=0.05)
    err = error_of(chat, engine, is_disconnected=_gone, stream=True)
    assert err.status_code == 499 and engine.aborted == ["chatcmpl-abc"]


def test_logprob_floor_for_json():
    from folio.entrypoints.openai.response_fields import clamp_logprob
    assert clamp_logprob(-math.inf) == -9999.0 and clamp_logprob(-1.0) == -1.0
