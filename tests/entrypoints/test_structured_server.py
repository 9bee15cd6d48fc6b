"""Constrained decoding and tool calling, end to end: a real `folio serve` per model (tiny
random-weight Qwen3 and Llama 3.1 models with their real tokenizers and chat templates, from
fixtures_tokenizers), driven by the official `openai` client.

Random weights mean that only the grammar makes an output valid, so every check here is a
check of the grammar (and of the parsers that turn its output into OpenAI fields). Two things
about random weights shape the requests:

* JSON lets whitespace go between any two tokens, and a BPE vocabulary has hundreds of
  whitespace-only tokens (441 in Qwen3's, 530 in Llama 3's): a random model, offered them at
  every step, spends its whole budget on whitespace. Requests whose grammar is JSON with free
  whitespace therefore carry a logit_bias of -100 on the whitespace-only tokens. That is not
  a mask: the grammar alone decides what is allowed, and mixed tokens such as '":\\r\\n' still
  come through (the raw outputs are full of them).
* Nothing makes a random model end a "required" array of calls: Llama's picks "," after a
  call about nine times in ten (21 calls in 986 tokens for one seed). A small bias (+5) on the
  tokens that close it (']', ']\\n', '}]', ...) keeps it to one to three calls.

Bounded strings use `pattern` rather than `maxLength`: xgrammar (0.2.9) compiles a string with
minLength/maxLength to `[^"\\\\\\r\\n]{m,n}`, which admits raw control characters (a tab), so the
"JSON" it allows is not JSON (json.loads refuses it) and a forced call's arguments would not
parse; a pattern is compiled with the JSON string rules.

The servers run with OMP_NUM_THREADS=1: on a busy 2-core machine torch's default two threads
made every decode step ~7x slower (vocab-sized sampling ops waiting on each other).
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import jsonschema
import openai
import pytest

from fixtures_tokenizers import tiny_model_dir as tool_model_dir
from server_utils import RemoteServer

pytestmark = pytest.mark.slow

PARSERS = {"qwen3": "hermes", "llama3": "llama3_json"}

BOUNDED_TEXT = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}
WEATHER = {
    "type": "object",
    "properties": {
        "city": BOUNDED_TEXT,
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
BOOKING = {
    "type": "object",
    "properties": {
        "restaurant": BOUNDED_TEXT,
        "party": {
            "type": "object",
            "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 12},
                           "name": BOUNDED_TEXT},
            "required": ["size", "name"],
            "additionalProperties": False,
        },
    },
    "required": ["restaurant", "party"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "book_table": BOOKING}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
                                      "parameters": BOOKING}},
]
QUESTION = [{"role": "user", "content": "What's the weather in Paris, and can you book a table?"}]
MAX_TOKENS = 300  # one call takes ~50 tokens


class Served:
    """One running server with what its requests need."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer
        self.name = name
        model_dir = tool_model_dir(name)
        whitespace, closers, quotes = [], [], []
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
            if text and text.isspace():
                whitespace.append(i)
            elif text.strip() and set(text.strip()) <= set("]}") and "]" in text:
                closers.append(i)
            elif text.strip() in ('"}', '":"', '":', ':"', '" :', '": "'):
                quotes.append(i)
        self.tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
        self.no_whitespace = {str(i): -100.0 for i in whitespace}
        self.end_arrays = {**self.no_whitespace, **{str(i): 5.0 for i in closers}}
        # Tokens that close a string (and the object, or open a value): see test_json_object.
        self.close_quotes = {**self.no_whitespace, **{str(i): 15.0 for i in quotes}}
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            self.server = RemoteServer([
                model_dir, "--max-model-len", "2048", "--kv-cache-memory-bytes", "67108864",
                "--dtype", "float32", "--max-num-seqs", "16",
                "--enable-auto-tool-choice", "--tool-call-parser", "auto"])
        self.client = self.server.client(timeout=120)
        self.model = self.client.models.list().data[0].id

    def chat(self, **kwargs: Any):
        kwargs.setdefault("messages", QUESTION)
        kwargs.setdefault("temperature", 1.0)
        return self.client.chat.completions.create(model=self.model, **kwargs)

    def complete(self, **kwargs: Any):
        kwargs.setdefault("temperature", 1.0)
        return self.client.completions.create(model=self.model, **kwargs)


@pytest.fixture(scope="module")
def launch():
    started: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in started:
            started[name] = Served(name)
        return started[name]
    yield get
    for served in started.values():
        served.server.stop()


@pytest.fixture(scope="module", params=list(PARSERS))
def tool_server(request, launch) -> Served:
    return launch(request.param)


@pytest.fixture(scope="module")
def qwen(launch) -> Served:
    return launch("qwen3")


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


class Reply(NamedTuple):
    calls: list[tuple[str, str]]  # (name, arguments)
    finish: str | None
    content: str | None
    fragments: int = 0  # streaming: the most argument deltas any one call arrived in


def _reply(response) -> Reply:
    choice = response.choices[0]
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
    return Reply([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
                 choice.finish_reason, choice.message.content)


def _stream_chat(served: Served, **kwargs: Any) -> Reply:
    """Assemble a streamed chat reply. Each call's first delta must carry its id and name;
    later ones only argument fragments."""
    calls: dict[int, dict[str, Any]] = {}
    content, finishes = "", []
    for chunk in served.chat(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.id.startswith("call_") and tc.function.name, tc
                    assert tc.index == len(calls), "calls must arrive in index order"
                    calls[tc.index] = {"name": tc.function.name, "arguments": "", "fragments": 0}
                else:
                    assert tc.id is None and (tc.function is None or tc.function.name is None), tc
                if tc.function is not None and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
                    calls[tc.index]["fragments"] += 1
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(finishes) == 1, finishes
    ordered = [calls[i] for i in sorted(calls)]
    return Reply([(c["name"], c["arguments"]) for c in ordered], finishes[0], content,
                 max((c["fragments"] for c in ordered), default=0))


# ---- tool calling, on both models ------------------------------------------------------

def test_auto_picks_the_parser_from_the_template(tool_server):
    with open(tool_server.server.log_path) as f:
        log = f.read()
    assert f"tool-call parser picked from the chat template: {PARSERS[tool_server.name]}" in log


def test_required_calls_validate(tool_server):
    def one(job: tuple[bool, int]):
        stream, seed = job
        kwargs = dict(tools=TOOLS, tool_choice="required", seed=seed, max_tokens=MAX_TOKENS,
                      logit_bias=tool_server.end_arrays)
        if stream:
            return _stream_chat(tool_server, **kwargs)
        return _reply(tool_server.chat(**kwargs))
    results = _parallel(one, [(False, 0), (False, 1), (False, 2), (True, 10), (True, 11), (True, 12)])
    seen = []
    for calls, finish, content, _ in results:
        assert finish == "tool_calls", (finish, content)
        assert calls and not content
        for name, arguments in calls:
            seen.append((name, json.dumps(_check_call(name, arguments), sort_keys=True)))
    assert len(set(seen)) == len(seen) > len(results)  # sampling varies; some made 2+ calls
    # Streamed arguments arrive as they are generated, not in one piece at the end.
    assert all(reply.fragments > 3 for reply in results[3:])


def test_required_without_parallel_calls_makes_one(tool_server):
    def one(stream: bool):
        kwargs = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=21,
                      max_tokens=MAX_TOKENS, logit_bias=tool_server.no_whitespace)
        return _stream_chat(tool_server, **kwargs) if stream else _reply(tool_server.chat(**kwargs))
    for calls, finish, content, _ in _parallel(one, [False, True]):
        assert finish == "tool_calls" and not content
        [(name, arguments)] = calls
        _check_call(name, arguments)


def test_named_function(tool_server):
    choice = {"type": "function", "function": {"name": "book_table"}}

    def one(job: tuple[bool, int]):
        stream, seed = job
        kwargs = dict(tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=MAX_TOKENS,
                      logit_bias=tool_server.no_whitespace)
        return _stream_chat(tool_server, **kwargs) if stream else _reply(tool_server.chat(**kwargs))
    for calls, finish, content, _ in _parallel(one, [(False, 3), (False, 4), (True, 5)]):
        assert finish == "stop" and not content  # OpenAI ends a named (forced) call with "stop"
        [(name, arguments)] = calls
        assert name == "book_table"
        _check_call(name, arguments)


def test_tool_choice_none(tool_server):
    reply = tool_server.chat(tools=TOOLS, tool_choice="none", seed=7, max_tokens=16)
    assert reply.choices[0].message.tool_calls is None
    assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The tools still reached the template.
    plain = tool_server.chat(seed=7, max_tokens=1)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_tool_choice_auto_never_fails(tool_server):
    def one(job: tuple[bool, int]):
        stream, seed = job
        kwargs = dict(tools=TOOLS, tool_choice="auto", seed=seed, max_tokens=40)
        if stream:
            return _stream_chat(tool_server, **kwargs)
        return _reply(tool_server.chat(**kwargs))
    for calls, finish, content, _ in _parallel(one, [(False, 0), (False, 1), (True, 0), (True, 1)]):
        assert finish in ("stop", "length", "tool_calls")
        assert calls or isinstance(content, str)
        for name, arguments in calls:  # junk, but if the parser saw a call it must parse
            assert name in SCHEMAS and isinstance(json.loads(arguments), dict)


def test_multi_turn_then_required(tool_server):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_abc123", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": json.dumps({"temperature_c": 21})},
        {"role": "user", "content": "Thanks. Now book a table for two."},
    ]
    reply = tool_server.chat(messages=messages, tools=TOOLS, tool_choice="required", seed=8,
                             max_tokens=MAX_TOKENS, logit_bias=tool_server.end_arrays)
    calls, finish, content, _ = _reply(reply)
    assert finish == "tool_calls" and calls and not content
    for name, arguments in calls:
        _check_call(name, arguments)
    single_turn = tool_server.chat(messages=messages[:1], tools=TOOLS, max_tokens=1, seed=8)
    assert reply.usage.prompt_tokens > single_turn.usage.prompt_tokens + 20


def test_auto_with_strict_tools_constrains_the_call(qwen):
    """tool_choice "auto" + `strict: true` functions: once the model opens <tool_call> (here
    pushed by a bias; a stop string ends the reply after the first call), the structural tag
    forces the hermes call format and the schema, so the call parses and validates."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]

    def one(seed: int):
        return _reply(qwen.chat(tools=strict, tool_choice="auto", seed=seed, max_tokens=MAX_TOKENS,
                                   logit_bias={**qwen.no_whitespace, str(qwen.tool_call_id): 100},
                                   stop=["</tool_call>"],
                                   extra_body={"include_stop_str_in_output": True}))
    for calls, finish, content, _ in _parallel(one, [0, 1, 2]):
        assert finish == "tool_calls" and not (content or "").strip()
        [(name, arguments)] = calls
        _check_call(name, arguments)


# ---- structured outputs, on one server ------------------------------------------------

def _json_schema(schema: dict, name: str = "booking") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_response_format_json_schema(qwen):
    def one(job: tuple[str, int]):
        where, seed = job
        if where == "chat":
            reply = qwen.chat(response_format=_json_schema(BOOKING), seed=seed, max_tokens=MAX_TOKENS,
                              logit_bias=qwen.no_whitespace)
            return reply.choices[0].finish_reason, reply.choices[0].message.content
        reply = qwen.complete(prompt="A booking as JSON:", seed=seed, max_tokens=MAX_TOKENS,
                              logit_bias=qwen.no_whitespace,
                              extra_body={"response_format": _json_schema(BOOKING)})
        return reply.choices[0].finish_reason, reply.choices[0].text
    for finish, text in _parallel(one, [("chat", 0), ("chat", 1), ("completions", 0), ("completions", 1)]):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), BOOKING)


def test_structured_outputs_json_options(qwen):
    """vLLM's structured_outputs json, with no bias: disable_any_whitespace gives exactly
    json.dumps' layout (xgrammar's fixed separators); a guidance-only whitespace_pattern
    ("auto" falls back to guidance) bounds the whitespace to what it matches."""
    compact = qwen.complete(prompt="JSON:", seed=1, max_tokens=MAX_TOKENS, extra_body={
        "structured_outputs": {"json": BOOKING, "disable_any_whitespace": True}}).choices[0]
    assert compact.finish_reason == "stop"
    value = json.loads(compact.text)
    jsonschema.validate(value, BOOKING)
    assert compact.text == json.dumps(value, ensure_ascii=False)
    spaced = qwen.chat(seed=2, max_tokens=MAX_TOKENS, extra_body={
        "structured_outputs": {"json": WEATHER, "whitespace_pattern": " ?"}}).choices[0]
    assert spaced.finish_reason == "stop"
    jsonschema.validate(json.loads(spaced.message.content), WEATHER)
    outside_strings = re.sub(r'"[^"]*"', '""', spaced.message.content)
    assert not re.search(r"\s\s|[\n\r\t]", outside_strings), spaced.message.content


def test_json_object(qwen):
    """Any JSON object. A random model left alone writes one long string after another, so
    the tokens that close a string (and the object) get a bias; the grammar still decides."""
    chat = qwen.chat(response_format={"type": "json_object"}, seed=0, max_tokens=MAX_TOKENS,
                     logit_bias=qwen.close_quotes).choices[0]
    done = qwen.complete(prompt="{", seed=3, max_tokens=MAX_TOKENS, logit_bias=qwen.close_quotes,
                         extra_body={"structured_outputs": {"json_object": True}}).choices[0]
    for finish, text in ((chat.finish_reason, chat.message.content), (done.finish_reason, done.text)):
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_regex_choice_and_grammars_on_completions(qwen):
    email = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)"
    cases = [
        ({"regex": email}, email),
        ({"choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
        # EBNF (xgrammar's dialect)
        ({"grammar": 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi" | "hey"\n'
                     'name ::= [A-Z] [a-z] [a-z] [a-z]?'}, r"(hello|hi|hey) [A-Z][a-z]{2,3}!"),
        # Lark: "auto" sends it to guidance
        ({"grammar": 'start: ANSWER "-" NUM\nANSWER: "yes" | "no"\nNUM: /[0-9]{2,3}/'},
         r"(yes|no)-[0-9]{2,3}"),
    ]

    def one(job: tuple[int, int]):
        case, seed = job
        return qwen.complete(prompt="Answer:", seed=seed, max_tokens=40,
                             extra_body={"structured_outputs": cases[case][0]}).choices[0]
    jobs = [(case, seed) for case in range(len(cases)) for seed in (0, 1)]
    for (case, _), choice in zip(jobs, _parallel(one, jobs)):
        assert choice.finish_reason == "stop"
        assert re.fullmatch(cases[case][1], choice.text), (cases[case][0], choice.text)
    # The same extra on chat.
    chat = qwen.chat(seed=0, max_tokens=8, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert chat.choices[0].message.content in ("left", "right")


def test_streaming_with_response_format(qwen):
    text, finishes = "", []
    for chunk in qwen.chat(response_format=_json_schema(WEATHER, "weather"), seed=4, max_tokens=MAX_TOKENS,
                           logit_bias=qwen.no_whitespace, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["stop"]
    jsonschema.validate(json.loads(text), WEATHER)
    pieces = [c.choices[0].text for c in qwen.complete(
        prompt="JSON:", seed=5, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}})]
    assert len(pieces) > 3
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)


def test_too_few_tokens_for_the_schema_is_length(qwen):
    long_array = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 50}
    done = qwen.complete(prompt="Digits:", seed=0, max_tokens=12, extra_body={
        "structured_outputs": {"json": long_array, "disable_any_whitespace": True}}).choices[0]
    assert done.finish_reason == "length"
    assert done.text.startswith("[") and re.fullmatch(r"\[[0-9, ]*", done.text), done.text
    chat = qwen.chat(response_format=_json_schema(long_array, "digits"), seed=0, max_tokens=12)
    assert chat.choices[0].finish_reason == "length"


# No backend enforces `uniqueItems` (xgrammar used to compile it without enforcing it).
UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 1, "maxItems": 3, "uniqueItems": True}


def _fallbacks(served: Served, reason: str) -> float:
    import httpx
    text = httpx.get(served.server.url + "/metrics", headers=served.server.headers).text
    line = f'folio:structured_outputs_fallbacks_total{{model_name="{served.model}",reason="{reason}"}}'
    [value] = [float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(line)]
    return value


def test_unenforceable_schema_is_a_400_unless_best_effort(qwen):
    """A schema no backend fully enforces is a 400 naming the keyword; with best_effort it
    runs (partially enforced), the response says what is not enforced, and /metrics counts
    the fallback by reason."""
    before = {r: _fallbacks(qwen, r) for r in ("best_effort_partial", "unenforced_feature")}
    with pytest.raises(openai.BadRequestError) as info:
        qwen.complete(prompt="Digits:", max_tokens=4, extra_body={
            "structured_outputs": {"json": UNIQUE}})
    error = info.value.response.json()["error"]
    assert error["param"] == "structured_outputs" and "`uniqueItems`" in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:
        qwen.chat(max_tokens=4, response_format=_json_schema(UNIQUE, "digits"))
    assert "`uniqueItems`" in info.value.response.json()["error"]["message"]

    body = {"structured_outputs": {"json": UNIQUE, "best_effort": True,
                                   "disable_any_whitespace": True}}
    done = qwen.complete(prompt="Digits:", seed=0, max_tokens=40, extra_body=body)
    assert "uniqueItems" in done.structured_outputs_notice
    assert done.choices[0].finish_reason == "stop"
    value = json.loads(done.choices[0].text)
    assert 1 <= len(value) <= 3 and all(0 <= v <= 9 for v in value)  # the rest is enforced
    chat = qwen.chat(seed=1, max_tokens=40, extra_body=body)
    assert "uniqueItems" in chat.structured_outputs_notice
    # A fully enforced constraint has no notice (the field is left out).
    plain = qwen.complete(prompt="hi", max_tokens=4, seed=0,
                          extra_body={"structured_outputs": {"choice": ["fine", "good"]}})
    assert "structured_outputs_notice" not in plain.model_dump()
    # Counted by reason: two best_effort requests; the 400s count nothing.
    assert _fallbacks(qwen, "best_effort_partial") == before["best_effort_partial"] + 2
    assert _fallbacks(qwen, "unenforced_feature") == before["unenforced_feature"]


@pytest.mark.parametrize("endpoint, body, mention, param", [
    ("chat", {"response_format": _json_schema({"type": "nonsense"})}, "nonsense",
     "response_format.json_schema.schema"),
    ("chat", {"response_format": _json_schema({"type": "nonsense"}), "stream": True}, "nonsense",
     "response_format.json_schema.schema"),
    ("completions", {"structured_outputs": {"regex": "(unclosed"}}, "regex", "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": 'root ::= "a" undefined_rule'}},
     "undefined_rule", "structured_outputs"),
    ("completions", {"structured_outputs": {"grammar": 'start: "a" undefined_rule'}},
     "undefined_rule", "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a+", "bogus_field": True}}, "bogus_field",
     "structured_outputs"),
    ("chat", {"response_format": {"type": "xml"}}, "xml", "response_format.type"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_fn"}}},
     "no_such_fn", "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], "tool_choice": "required"}, "nonsense", "tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice"),
])
def test_bad_constraints_are_400s(qwen, endpoint, body, mention, param):
    body = dict(body)
    stream = body.pop("stream", False)
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            qwen.chat(max_tokens=4, stream=stream, extra_body=body)
        else:
            qwen.complete(prompt="hi", max_tokens=4, stream=stream, extra_body=body)
    assert info.value.status_code == 400
    error = info.value.response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert mention in error["message"], error
    # ...and the server keeps serving, constrained requests included.
    ok = qwen.complete(prompt="hi", max_tokens=4, seed=0,
                       extra_body={"structured_outputs": {"choice": ["fine", "good"]}})
    assert ok.choices[0].text in ("fine", "good")
