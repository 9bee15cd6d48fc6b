"""Property-based tests (hypothesis) of the OpenAI request models and handlers.

Every completions / chat request body, valid or not, goes the server's way: JSON text ->
`_read_json` -> pydantic (`CompletionRequest` / `ChatCompletionRequest`) -> the handler ->
the engine's front end. Either
  * pydantic refuses it, and `validation_error_to_openai` makes a 400 whose `param` is a
    field the client sent (or a path into one), or
  * the handler raises an OpenAIError 4xx whose `param` is a field the client sent, or
  * it answers: a response with n choices per prompt (or, streaming, well-formed SSE events
    ending in [DONE], with no in-stream error), serializable as strict JSON.
No other exception may escape: on the server it would be a 500.

The engine stand-in runs the real front end (`RequestPreparer.prepare`: request limits,
vocabulary and KV-fit checks, tokenization) and the msgpack wire to the engine core, then
answers with scripted tokens instead of running a model.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, AsyncIterator

import pydantic
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from folio.engine import messages as wire
from folio.engine.frontend import ModelInfo, RequestPreparer
from folio.entrypoints.openai.api_server import ServerSettings, _read_json
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

import model_utils

MODEL = "smol"
VOCAB = model_utils.TINY_VOCAB
MAX_MODEL_LEN = 128
KV_CAPACITY_TOKENS = 64 * 16
_LEADING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---------------------------------------------------------------------------------------
# The engine stand-in
# ---------------------------------------------------------------------------------------

class PreparingEngine:
    """What the handlers use of AsyncLLM. `generate` does what AsyncLLM does before the engine
    core (prepare, then encode each child request for the wire), then yields a scripted
    completion per child in the requested output kind."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = MAX_MODEL_LEN
        info = ModelInfo(source=None, hf_config=None, tokenizer=tokenizer,
                         generation_config=None, eos_token_ids=(tokenizer.eos_token_id,),
                         vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
        self.preparer = RequestPreparer(info)
        self.preparer.kv_capacity_tokens = KV_CAPACITY_TOKENS
        self.script = tokenizer.encode(" Hello there, friend! How are you?",
                                       add_special_tokens=False)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def _position(self, tid: int, k: int, lp: float) -> dict[int, Logprob]:
        position = {tid: Logprob(lp, 1, self.tokenizer.decode([tid]))}
        for r in range(max(k, 0)):
            alt = (tid + r + 1) % VOCAB
            position.setdefault(alt, Logprob(lp - 1.0 - r, r + 2, self.tokenizer.decode([alt])))
        return position

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        prepared = self.preparer.prepare(request_id, prompt, params, priority=priority,
                                         cache_salt=cache_salt)
        for core_request in prepared.core_requests:
            kind, decoded = wire.decode(wire.encode(wire.ADD, core_request))
            assert kind == wire.ADD and decoded.request_id == core_request.request_id
        prompt_ids = prepared.prompt.prompt_token_ids
        params = prepared.child_params[0]
        room = MAX_MODEL_LEN - len(prompt_ids)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        tokens = self.script[:limit]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._position(t, params.prompt_logprobs, -1.0)
                                        for t in prompt_ids[1:]]
        n = len(prepared.child_ids)
        delta = params.output_kind == RequestOutputKind.DELTA
        steps = range(1, len(tokens) + 1) if delta else [len(tokens)]
        sent = 0
        for end in steps:
            await asyncio.sleep(0)
            last = end == len(tokens)
            new = tokens[sent if delta else 0:end]
            reason = ("length" if len(tokens) == limit else "stop") if last else None
            outputs = [CompletionOutput(
                index=j, text=self.tokenizer.decode(new), token_ids=list(new),
                cumulative_logprob=-0.5 * end,
                logprobs=(None if params.logprobs is None
                          else [self._position(t, params.logprobs, -0.5) for t in new]),
                finish_reason=reason) for j in range(n)]
            sent = end
            yield RequestOutput(request_id=request_id, prompt=prepared.prompt.prompt,
                                prompt_token_ids=prompt_ids,
                                prompt_logprobs=prompt_logprobs if end == steps[0] or not delta
                                else None,
                                outputs=outputs, finished=last)


# ---------------------------------------------------------------------------------------
# Strategies: request bodies as JSON values
# ---------------------------------------------------------------------------------------

def _values(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
STRICT_TOOL = {"type": "function", "function": {
    "name": "get_time", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
USER = {"role": "user", "content": "Say hello"}

COMMON_VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": _values(MODEL, None, ""),
    "n": _values(1, 2, 3, None),
    "stream": _values(True, False, None),
    "stream_options": _values({"include_usage": True},
                              {"include_usage": True, "continuous_usage_stats": True}, None),
    "temperature": _values(0.0, 0.7, 1, 2.0, None),
    "top_p": _values(0.5, 1.0, None),
    "stop": _values("\n", ["a", "b"], [], None, "friend"),
    "presence_penalty": _values(0.5, -2, 2.0, None),
    "frequency_penalty": _values(-0.5, 0, None),
    "logit_bias": _values({"42": 5}, {"1": -100, " 2 ": 100.0}, {}, None),
    "seed": _values(7, -1, 2**63 - 1, -(2**63), None),
    "user": _values("u1", None),
    "top_k": _values(20, 0, -1, VOCAB, 10**6, None),
    "min_p": _values(0.05, 0, 1, None),
    "repetition_penalty": _values(1.1, 0.5, None),
    "min_tokens": _values(0, 1, None),
    "ignore_eos": _values(True, False, None),
    "stop_token_ids": _values([2], [], [VOCAB - 1], None),
    "include_stop_str_in_output": _values(True, False),
    "skip_special_tokens": _values(True, False),
    "spaces_between_special_tokens": _values(True, False),
    "prompt_logprobs": _values(0, 2, 20, None),
    "truncate_prompt_tokens": _values(5, -1, 1000, None),
    "allowed_token_ids": _values([1, 2, 3], [VOCAB - 1], None),
    "bad_words": _values(["bad"], ["two words"], [], None),
    "cache_salt": _values("salt", None),
    "priority": _values(0, 3, -5, 2**63 - 1),
    "return_token_ids": _values(True, False, None),
    "request_id": _values("req-1", None),
    "structured_outputs": _values({"regex": "[a-z]+"}, {"choice": ["yes", "no"]},
                                  {"json": {"type": "object"}}, {"json_object": True}, None),
    "response_format": _values({"type": "text"}, {"type": "json_object"},
                               {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "object", "properties": {
                                       "a": {"type": "integer"}}}}},
                               {"type": "json_schema", "json_schema": {"name": "x"}}, None),
    "unknown_extra_field": _values("ignored", 5),
}

COMMON_INVALID: dict[str, st.SearchStrategy[Any]] = {
    "model": _values("no-such-model", 5, ["smol"]),
    "n": _values(0, -1, 129, 100, 10**9, 2**64, "two", 1.5, [1]),
    "stream": _values("maybe", 3, [True]),
    "stream_options": _values({"include_usage": "maybe"}, "x", 5),
    "temperature": _values(-1, "hot", math.nan, math.inf, -math.inf, [1.0]),
    "top_p": _values(0, 1.5, -1, math.nan, "x"),
    "stop": _values([""], "", [1], 5, ["x"] * 65, ["x" * 513], {"a": 1}, [None]),
    "presence_penalty": _values(3, -3, "x", math.inf),
    "frequency_penalty": _values(2.5, math.nan),
    "logit_bias": _values({"abc": 1}, {"42": 101}, {"42": -1000}, {"42": "x"}, {"-1": 1},
                          {str(VOCAB): 1}, {"1.5": 1}, [1], {"1": math.nan}, {"1": math.inf},
                          {"9" * 20: 1}, {"9" * 400: 1}, {str(i): 0 for i in range(1025)},
                          {"": 1}, {"1": None}),
    "seed": _values(2**63, -(2**63) - 1, 2**64, 10**30, "7", 1.5),
    "user": _values(5, ["u"]),
    "top_k": _values(-2, 2**64, 2**63, 10**30, -(10**30), "x", 1.5),
    "min_p": _values(-0.1, 1.5, math.nan),
    "repetition_penalty": _values(0, -1, math.inf),
    "min_tokens": _values(-1, 10**6, 2**64, "x"),
    "ignore_eos": _values("maybe", 2, [True]),
    "stop_token_ids": _values([-1], [VOCAB], [True], [1.5], ["2"], "x", list(range(4097)),
                              [2**64], [10**9]),
    "include_stop_str_in_output": _values("maybe", [1]),
    "skip_special_tokens": _values("maybe", 7),
    "spaces_between_special_tokens": _values({}, 7),
    "prompt_logprobs": _values(-1, -2, 21, 10**6, 2**64, "x"),
    "truncate_prompt_tokens": _values(0, -2, 2**64, 2**63, "x"),
    "allowed_token_ids": _values([], [VOCAB], [-1], [True], list(range(4097)), "x", [2**64]),
    "bad_words": _values([""], ["w"] * 257, ["w" * 513], "x", [1]),
    "cache_salt": _values("", 5),
    "priority": _values("x", 1.5, 2**64, 2**63, -(2**63) - 1, None),
    "return_token_ids": _values("maybe", 3),
    "request_id": _values(5, ["r"]),
    "structured_outputs": _values({"regex": "("}, {"bogus": 1}, "x", {"choice": []}, {},
                                  {"json": {"type": "no-such-type"}}, {"json": "{not json"},
                                  {"regex": "a", "choice": ["a"]}, {"grammar": "root ::= "},
                                  {"regex": "a" * (1 << 20 + 1)}, {"choice": [1, 2]}),
    "response_format": _values({"type": "bogus"}, {"type": "json_schema"}, {"type": 5},
                               {"type": "json_schema", "json_schema": "x"}, "x",
                               {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "no-such-type"}}},
                               {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": "not a schema"}}),
}

COMPLETION_VALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": _values("Once upon a time", ["a", "b"], [1, 2, 3], [[1, 2], [3]],
                      ["x", [4, 5]], "word " * 120),
    "max_tokens": _values(1, 4, 16, None, MAX_MODEL_LEN),
    "logprobs": _values(0, 3, 20, None),
    "echo": _values(True, False, None),
    "best_of": _values(None),  # set to n below
    "suffix": _values(None),
}
COMPLETION_INVALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": _values("", [], [""], [[]], [1, 2, VOCAB], [-1], ["hi"] * 257, 5, None, [1.5],
                      [["a"]], "word " * 300, list(range(200)), [True], [[1, 2**64]],
                      list(range(MAX_MODEL_LEN)), {"a": 1}),
    "suffix": _values("x", 5),
    "max_tokens": _values(0, -1, 10**12, MAX_MODEL_LEN + 1, 2**64, "5", 1.5),
    "logprobs": _values(-1, 21, 2**64, "x"),
    "echo": _values("maybe", 3),
    "best_of": _values(0, 1000, 5, "x"),
}

CHAT_VALID: dict[str, st.SearchStrategy[Any]] = {
    "messages": _values([USER], [{"role": "system", "content": "Be brief"}, USER],
                        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                        [USER, {"role": "assistant", "content": "Hello"}, USER],
                        [{"role": "developer", "content": "Be kind"}, USER],
                        [USER, {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {
                                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]),
    "max_tokens": _values(1, 4, None),
    "max_completion_tokens": _values(2, MAX_MODEL_LEN, None),
    "logprobs": _values(True, False, None),
    "top_logprobs": _values(0, 5, 20, None),
    "tools": _values([WEATHER_TOOL], [WEATHER_TOOL, STRICT_TOOL], None),
    "tool_choice": _values("none", "auto", "required", None,
                           {"type": "function", "function": {"name": "get_weather"}}),
    "parallel_tool_calls": _values(True, False, None),
    "add_generation_prompt": _values(True, False),
    "continue_final_message": _values(False, True),
    "chat_template": _values(None, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                   "{% endfor %}"),
    "chat_template_kwargs": _values({"enable_thinking": False}, {}, None),
}
CHAT_INVALID: dict[str, st.SearchStrategy[Any]] = {
    "messages": _values([], "hello", [5], [{"role": "bogus", "content": "x"}],
                        [{"content": "x"}], [{"role": "user", "content": 5}],
                        [{"role": "user", "content": [{"type": "image_url",
                                                       "image_url": {"url": "x"}}]}],
                        [{"role": "user", "content": [{"text": "x"}]}],
                        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                        [{"role": "user", "content": "word " * 300}],
                        [{"role": "assistant", "content": "x", "tool_calls": "x"}],
                        [{"role": "assistant", "content": "x", "tool_calls": [5]}], None),
    "max_tokens": _values(0, -1, 10**12, "x"),
    "max_completion_tokens": _values(0, MAX_MODEL_LEN + 1, 2**64, -5),
    "logprobs": _values("maybe", 5, [True]),
    "top_logprobs": _values(-1, 21, 2**64, "x"),
    "tools": _values([{"type": "function"}], [{"type": "retrieval"}], [5], "x",
                     [{"type": "function", "function": {"name": 5}}],
                     [{"type": "function", "function": "get_weather"}],
                     [{"type": "function", "function": {"name": "f",
                                                        "parameters": {"type": "no-such"}}}],
                     [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
    "tool_choice": _values("bogus", 5, {"type": "function"}, {"function": {"name": "x"}},
                           {"type": "function", "function": {"name": "nope"}},
                           {"type": "function", "function": "get_weather"}),
    "parallel_tool_calls": _values("maybe", 3),
    "add_generation_prompt": _values("maybe", None),
    "continue_final_message": _values("maybe", 3),
    "chat_template": _values("{% for %}", "{{ raise_exception('no') }}", 5, "{{ 1/0 }}",
                             "{{ messages[99]['content'] }}"),
    "chat_template_kwargs": _values("x", {"tokenize": True}, {"messages": []},
                                    {"return_dict": True}, {"tools": 5}, [1]),
}


def _bodies(valid: dict[str, st.SearchStrategy[Any]], invalid: dict[str, st.SearchStrategy[Any]],
            required: str, fix: Any) -> st.SearchStrategy[tuple[dict[str, Any], set[str], bool]]:
    @st.composite
    def strategy(draw: st.DrawFn) -> tuple[dict[str, Any], set[str], bool]:
        names = sorted(valid)
        # Each optional field with probability ~1/4; the required one always.
        chosen = {n for n in names if draw(st.integers(0, 3), label=f"give {n}") == 0}
        body = {n: draw(valid[n], label=n) for n in sorted(chosen | {required})}
        tool_parser = draw(st.booleans(), label="server with a tool parser")
        tool_parser = fix(body, tool_parser)
        num_invalid = draw(st.sampled_from([0, 0, 0, 1, 1, 2]), label="how many invalid")
        bad = set(draw(st.lists(st.sampled_from(sorted(invalid)), min_size=num_invalid,
                                max_size=num_invalid), label="invalid fields"))
        for name in sorted(bad):
            body[name] = draw(invalid[name], label=f"invalid {name}")
        if draw(st.sampled_from([False] * 9 + [True]), label="drop the required field?"):
            del body[required]
            bad.add(required)
        return body, bad, tool_parser
    return strategy()


def _fix_common(body: dict[str, Any]) -> None:
    """Cross-field rules, so that a body of valid values is a valid request."""
    if body.get("stream_options") is not None:
        body["stream"] = True
    if (body.get("n") or 1) > 1 and body.get("temperature") == 0.0:
        body["temperature"] = 1.0  # n > 1 needs random sampling
    rf = body.get("response_format")
    if rf is not None and rf.get("type") != "text":
        body.pop("structured_outputs", None)  # at most one constraint source


def _fix_completion(body: dict[str, Any], tool_parser: bool) -> bool:
    _fix_common(body)
    if "best_of" in body:
        body["best_of"] = body.get("n") or 1
    return tool_parser


def _fix_chat(body: dict[str, Any], tool_parser: bool) -> bool:
    _fix_common(body)
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
        body["messages"] = body["messages"] + [{"role": "assistant", "content": "Hel"}]
    if body.get("top_logprobs"):
        body["logprobs"] = True
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools and choice not in (None, "none"):
        body["tool_choice"] = "none"
    if tools and choice in (None, "auto"):
        tool_parser = True  # "auto" needs --enable-auto-tool-choice and a parser
    if tools and (choice == "required" or isinstance(choice, dict)):
        body.pop("response_format", None)  # a forced call already fixes the shape
        body.pop("structured_outputs", None)
    return tool_parser


completion_bodies = _bodies(COMMON_VALID | COMPLETION_VALID, COMMON_INVALID | COMPLETION_INVALID,
                            "prompt", _fix_completion)
chat_bodies = _bodies(COMMON_VALID | CHAT_VALID, COMMON_INVALID | CHAT_INVALID, "messages",
                      _fix_chat)


# ---------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------

class _Body:
    """What `_read_json` reads of a Starlette request."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def stream(self) -> AsyncIterator[bytes]:
        yield self.data


_SERVER = ServerSettings(served_model_names=[MODEL])


def _read(body: dict[str, Any]) -> Any:
    """The body as the server sees it: JSON text (NaN and Infinity included, as Python's json
    writes them and the server's json.loads reads them), parsed by `_read_json`."""
    raw = json.dumps(body).encode()
    return asyncio.run(_read_json(_Body(raw), _SERVER.max_request_body_bytes,
                                  _SERVER.max_json_depth))


def _assert_param_names_a_sent_field(error: OpenAIError, model: type[pydantic.BaseModel],
                                     data: dict[str, Any]) -> None:
    assert error.param is not None, f"no param: {error!r}"
    match = _LEADING_NAME.match(error.param)
    root = match.group(0) if match else None
    assert root in model.model_fields, f"param is not a request field: {error!r}"
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    assert root in data or root in required, (
        f"param names a field the client did not send: {error!r}")


async def _drain(call: Any) -> Any:
    """Await the handler; a stream is drained in the same event loop."""
    result = await call
    if hasattr(result, "__aiter__"):
        return [item async for item in result]
    return result


def _check_response(result: Any, model: type[pydantic.BaseModel], request: Any) -> None:
    n = request.n or 1
    if model is CompletionRequest:
        prompt = request.prompt
        single = isinstance(prompt, str) or (bool(prompt) and all(isinstance(t, int)
                                                                 for t in prompt))
        num_choices = n * (1 if single else len(prompt))
        response_type = CompletionResponse
    else:
        num_choices = n
        response_type = ChatCompletionResponse
    if not request.stream:
        assert isinstance(result, response_type), type(result)
        assert sorted(c.index for c in result.choices) == list(range(num_choices))
        assert all(c.finish_reason in ("stop", "length", "tool_calls") for c in result.choices)
        usage = result.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        json.dumps(result.model_dump(), allow_nan=False)  # what JSONResponse writes
        return
    assert isinstance(result, list) and result and result[-1] == "data: [DONE]\n\n", result[-1:]
    indices = set()
    for sse in result[:-1]:
        assert sse.startswith("data: ") and sse.endswith("\n\n"), sse
        payload = json.loads(sse[len("data: "):-2])
        assert "error" not in payload, payload
        indices.update(c["index"] for c in payload["choices"])
    assert indices == set(range(num_choices))


@pytest.fixture(scope="module")
def handlers(smollm2_tokenizer) -> dict[str, Any]:
    engine = PreparingEngine(smollm2_tokenizer)
    return {
        "completion": OpenAIServingCompletion(engine, [MODEL, "alias"]),
        "chat": OpenAIServingChat(engine, [MODEL]),
        "chat+tools": OpenAIServingChat(engine, [MODEL], tool_call_parser="hermes",
                                        enable_auto_tool_choice=True),
    }


_outcomes: dict[str, set[str]] = {}


def _run_case(handlers: dict[str, Any], model: type[pydantic.BaseModel],
              case: tuple[dict[str, Any], set[str], bool]) -> str:
    body, invalid, tool_parser = case
    note(f"body={body!r}\ninvalid={sorted(invalid)} tool_parser={tool_parser}")
    data = _read(body)
    try:
        request = model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = validation_error_to_openai(exc)
        note(f"pydantic: {error!r}")
        assert error.status_code == 400
        _assert_param_names_a_sent_field(error, model, data)
        assert invalid, f"valid request refused: {error!r}"
        return "refused by the request model"
    if model is CompletionRequest:
        call = handlers["completion"].create_completion(request, request_id="cmpl-prop")
    else:
        handler = handlers["chat+tools" if tool_parser else "chat"]
        call = handler.create_chat_completion(request, request_id="chat-prop")
    try:
        result = asyncio.run(_drain(call))
    except OpenAIError as error:
        note(f"handler: {error!r}")
        assert 400 <= error.status_code < 500, error
        _assert_param_names_a_sent_field(error, model, data)
        assert invalid, f"valid request refused: {error!r}"
        event(f"handler refused: param {error.param.split('[')[0].split('.')[0]}")
        return "refused by the handler"
    _check_response(result, model, request)
    for name in ("tools", "response_format", "structured_outputs", "logprobs", "echo", "n",
                 "prompt_logprobs", "truncate_prompt_tokens"):
        if data.get(name):
            event(f"served with {name}")
    return "served (stream)" if request.stream else "served"


_SETTINGS = settings(max_examples=600, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                            HealthCheck.data_too_large])


@_SETTINGS
@given(case=completion_bodies)
def test_completion_requests_are_refused_by_name_or_served(handlers, case):
    outcome = _run_case(handlers, CompletionRequest, case)
    event(outcome)
    _outcomes.setdefault("completion", set()).add(outcome)


@_SETTINGS
@given(case=chat_bodies)
def test_chat_requests_are_refused_by_name_or_served(handlers, case):
    outcome = _run_case(handlers, ChatCompletionRequest, case)
    event(outcome)
    _outcomes.setdefault("chat", set()).add(outcome)


def test_the_properties_saw_every_outcome():
    everything = {"refused by the request model", "refused by the handler", "served",
                  "served (stream)"}
    for route, seen in _outcomes.items():
        assert seen == everything, (route, seen)


# ---------------------------------------------------------------------------------------
# The checker itself
# ---------------------------------------------------------------------------------------

def test_the_param_check_would_catch_a_bad_param():
    data = {"prompt": "x", "n": 2}
    for param in (None, "detokenize", "max_tokens", "the"):
        with pytest.raises(AssertionError):
            _assert_param_names_a_sent_field(OpenAIError("x", param=param), CompletionRequest,
                                             data)
    _assert_param_names_a_sent_field(OpenAIError("x", param="n"), CompletionRequest, data)
    _assert_param_names_a_sent_field(OpenAIError("x", param="prompt[0]"), CompletionRequest,
                                     data)


# ---------------------------------------------------------------------------------------
# Bodies that are not JSON objects, or not JSON at all
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",  # json.loads refuses > 4,300 digits
    b'{"prompt": "x", "n": -' + b"1" * 4301 + b"}",
    b'{"prompt": "x", "logit_bias": {"1": 1' + b"0" * 5000 + b"}}",
    b'{"prompt": "x"', b"[1, 2]", b"", b"\xff\xfe", b'"just a string"',
    b"[" * 10_000 + b"]" * 10_000, b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}",
])
def test_bodies_that_are_not_json_objects_are_400s(raw):
    with pytest.raises(OpenAIError) as info:
        asyncio.run(_read_json(_Body(raw), _SERVER.max_request_body_bytes,
                               _SERVER.max_json_depth))
    assert info.value.status_code == 400, info.value


@pytest.mark.parametrize("route, field, value", [
    ("completion", "priority", 2**64),  # was a 500: msgpack cannot carry it to the core
    ("completion", "top_k", 2**64),
    ("chat", "truncate_prompt_tokens", 2**64),
    ("chat", "top_k", 10**30),
    ("completion", "temperature", 10**400),  # JSON int too big for a float
])
def test_huge_numbers_are_400s_naming_the_field(handlers, route, field, value):
    body = ({"model": MODEL, "prompt": "Hi", "max_tokens": 2} if route == "completion"
            else {"model": MODEL, "messages": [USER], "max_tokens": 2})
    body[field] = value
    model = CompletionRequest if route == "completion" else ChatCompletionRequest
    data = _read(body)
    try:
        request = model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = validation_error_to_openai(exc)
    else:
        call = (handlers["completion"].create_completion(request, request_id="cmpl-x")
                if route == "completion"
                else handlers["chat"].create_chat_completion(request, request_id="chat-x"))
        with pytest.raises(OpenAIError) as info:
            asyncio.run(_drain(call))
        error = info.value
    assert error.status_code == 400 and error.param == field, error
