"""Tool-call parsers: recorded outputs, non-streaming and streaming agreement.

Every sample is streamed whole, split at every character boundary (all
two-piece splits) and one character at a time; the reassembled stream must
equal ``extract()``: same content (so no marker leaks) and JSON-equal
arguments per call, with id+name before any argument fragment.
"""
from __future__ import annotations

import itertools
import json

import pytest

from folio.entrypoints.openai.tool_parsers import (TOOL_PARSERS, ToolParser,
                                                   detect_tool_parser,
                                                   get_tool_parser,
                                                   make_tool_call_id,
                                                   tool_parser_for_template)


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024d}"


def _stream(cls: type[ToolParser], pieces: list[str], tools=None):
    parser = cls(tools, id_factory=_ids())
    content = ""
    calls: dict[int, dict] = {}
    deltas = [parser.extract_streaming(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        if d is None:
            continue
        assert d.content or d.tool_calls, "empty deltas must be None"
        content += d.content or ""
        for tc in d.tool_calls:
            if tc.index not in calls:
                # the first delta of a call carries its id and name
                assert tc.index == len(calls)
                assert tc.id and tc.name and tc.arguments is None
                calls[tc.index] = {"id": tc.id, "name": tc.name, "arguments": ""}
            else:
                assert tc.id is None and tc.name is None and tc.arguments
                calls[tc.index]["arguments"] += tc.arguments
    return content, [calls[i] for i in range(len(calls))]


def _splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def check(cls: type[ToolParser], text: str, tools=None, stream: bool = True):
    expected = cls(tools, id_factory=_ids()).extract(text)
    if not stream:
        return expected
    for pieces in _splits(text):
        content, calls = _stream(cls, pieces, tools)
        got = [(c["name"], json.loads(c["arguments"])) for c in calls]
        want = [(c.name, json.loads(c.arguments)) for c in expected.tool_calls]
        assert got == want, pieces
        if expected.tools_called:
            # exactly the full reply's content: whitespace-only content beside the calls is
            # not streamed either (it had been, as a newline between two calls)
            assert (content or None) == expected.content, pieces
        else:
            assert content == expected.content == text, pieces
    return expected


def calls_of(result):
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


NESTED = {"q": "a \"quoted\" } { ] [ string", "n": {"deep": [1, 2.5, True, None, {"x": "y"}]},
          "u": "héllo 世界 🙂"}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)

# ----------------------------------------------------------------- hermes

HERMES = get_tool_parser("hermes")


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>\nDone.',
     "Let me check.\n\n\nDone.", [("a", {}), ("b", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": ' + NESTED_JSON + '}</tool_call>',
     None, [("f", NESTED)]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call> <tool_call> \\"x\\""}}</tool_call>',
     None, [("f", {"s": "</tool_call> <tool_call> \"x\""})]),
    # missing closing tag at the end (stopped on EOS)
    ('<tool_call>{"arguments": {"a": [1]}, "name": "f"}', None, [("f", {"a": [1]})]),
    # arguments sent as a JSON-encoded string
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("Just text, no calls. <tool_ <b>", "Just text, no calls. <tool_ <b>", []),
    ("", "", []),
    # whitespace around and between calls is no content, streamed or not; alone it is
    ('\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n', None, [("a", {}), ("b", {})]),
    ("\n  \n", "\n  \n", []),
])
def test_hermes(text, content, calls):
    r = check(HERMES, text)
    assert r.content == content and calls_of(r) == calls and r.tools_called == bool(calls)


@pytest.mark.parametrize("text,stream", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', False),  # unterminated JSON
    ('<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', False),  # bad JSON
    ("Hi <tool_call>not json</tool_call>", True),
    ('<tool_call>{"arguments": {}}</tool_call>', True),  # no name
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', True),
    ("<tool_call>", True),
])
def test_hermes_malformed(text, stream):
    r = check(HERMES, text, stream=stream)
    assert not r.tools_called and r.tool_calls == [] and r.content == text


def test_ids_random_and_injectable():
    ids = {make_tool_call_id() for _ in range(50)}
    assert len(ids) == 50
    for i in ids:
        assert i.startswith("call_") and len(i) == 29 and i[5:].isalnum()
    r = HERMES().extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert r.tool_calls[0].id.startswith("call_")
    r = HERMES(id_factory=lambda: "call_x").extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert r.tool_calls[0].id == "call_x"


def test_streaming_fragments_are_incremental():
    text = '<tool_call>{"name": "f", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    p = HERMES(id_factory=_ids())
    frags = []
    for ch in text:
        d = p.extract_streaming(ch)
        frags += [tc.arguments for tc in (d.tool_calls if d else []) if tc.arguments]
    assert p.finish() is None
    assert len(frags) > 5 and json.loads("".join(frags)) == {"city": "Paris", "days": 3}

# ----------------------------------------------------------------- llama3_json

LLAMA3 = get_tool_parser("llama3_json")


@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     None, [("a", {"x": 1}), ("b", {})]),
    ('Sure. <|python_tag|>{"type": "function", "name": "f", "parameters": ' + NESTED_JSON + '}',
     "Sure. ", [("f", NESTED)]),
    ('  {"name": "f", "parameters": {"s": "<|python_tag|>{\\"name\\": 1};"}}', None,
     [("f", {"s": "<|python_tag|>{\"name\": 1};"})]),
    ('{"answer": 42}', '{"answer": 42}', []),  # plain JSON answer, not a call
    ("The weather is nice.", "The weather is nice.", []),
])
def test_llama3(text, content, calls):
    r = check(LLAMA3, text)
    assert r.content == content and calls_of(r) == calls


@pytest.mark.parametrize("text,stream", [
    ('{"name": "f", "parameters": {"a": ', False),
    ('{"name": "f", "parameters": {"a": 1}} trailing', False),
    ('<|python_tag|>{"nam', True),
    ("{not json}", True),
])
def test_llama3_malformed(text, stream):
    r = check(LLAMA3, text, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- pythonic

PYTHONIC = get_tool_parser("pythonic")


@pytest.mark.parametrize("text,content,calls", [
    ('[get_weather(city="Paris", days=3)]', None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("[a(x=1, y='two'), b()]", None, [("a", {"x": 1, "y": "two"}), ("b", {})]),
    ('[f(q="a \\"b\\" ) ] , (", l=[1, -2.5, {"k": (True, None)}], u="héllo 世界", j=true, n=null,)]',
     None, [("f", {"q": 'a "b" ) ] , (', "l": [1, -2.5, {"k": [True, None]}], "u": "héllo 世界",
                   "j": True, "n": None})]),
    ('[ns.tool(s="""multi\nline""")]', None, [("ns.tool", {"s": "multi\nline"})]),
    ('I will call it. <|python_start|>[f(a=1)]<|python_end|> ok', "I will call it.  ok",
     [("f", {"a": 1})]),
    ("<|python_start|>[f(a=1), g(b=[])]", None, [("f", {"a": 1}), ("g", {"b": []})]),
    ("[1] See the footnote.", "[1] See the footnote.", []),
    ("[Link](http://x.y) here", "[Link](http://x.y) here", []),
    ("No calls here.", "No calls here.", []),
])
def test_pythonic(text, content, calls):
    r = check(PYTHONIC, text)
    assert r.content == content and calls_of(r) == calls


@pytest.mark.parametrize("text,stream", [
    ("[f(a=1)", False),  # unterminated
    ("[f(1, 2)]", False),  # positional arguments
    ("[f(a=__import__('os').system('x'))]", False),  # never evaluated
    ("[f(a=1)] and then text", False),
    ("[]", True),
])
def test_pythonic_malformed(text, stream):
    r = check(PYTHONIC, text, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- mistral

MISTRAL = get_tool_parser("mistral")


@pytest.mark.parametrize("text,content,calls", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ('Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"s": "[TOOL_CALLS]]"}}, '
     '{"name": "b", "arguments": ' + NESTED_JSON + '}]', "Checking. ",
     [("a", {"s": "[TOOL_CALLS]]"}), ("b", NESTED)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris [ARGS]"}', None,
     [("get_weather", {"city": "Paris [ARGS]"})]),
    ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"x": 1}), ("b", {})]),
    ('[TOOL_CALLS]a[CALL_ID]abc123XYZ[ARGS]{"x": "ü"}', None, [("a", {"x": "ü"})]),
    ("Plain [text] with [TOOL brackets", "Plain [text] with [TOOL brackets", []),
])
def test_mistral(text, content, calls):
    r = check(MISTRAL, text)
    assert r.content == content and calls_of(r) == calls


@pytest.mark.parametrize("text,stream", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', False),
    ("[TOOL_CALLS]f[ARGS]not json", False),
    ("[TOOL_CALLS]", True),
    ("[TOOL_CALLS] [1, 2]", True),
])
def test_mistral_malformed(text, stream):
    r = check(MISTRAL, text, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- qwen3_xml

QWEN3 = get_tool_parser("qwen3_xml")
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "score": {"type": "number"},
    "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": ["array", "null"]},
}}}}]


@pytest.mark.parametrize("text,content,calls", [
    ("<tool_call>\n<function=search>\n<parameter=query>\nfolio {engine} \"x\"\n</parameter>\n"
     "<parameter=limit>\n5\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n"
     "<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n{\"lang\": \"py\"}\n</parameter>\n"
     "<parameter=tags>\n['a', 'ü']\n</parameter>\n</function>\n</tool_call>",
     None, [("search", {"query": 'folio {engine} "x"', "limit": 5, "score": 0.5, "exact": True,
                        "filters": {"lang": "py"}, "tags": ["a", "ü"]})]),
    ("I'll search.\n<tool_call>\n<function=search>\n<parameter=limit>\n10\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=other>\n<parameter=limit>\n10\n</parameter>\n"
     "<parameter=code>\ndef f():\n    return '<tool_call>'\n\n</parameter>\n</function>\n</tool_call>",
     "I'll search.\n\n", [("search", {"limit": 10}),
                          ("other", {"limit": "10", "code": "def f():\n    return '<tool_call>'\n"})]),
    # missing </parameter> and </tool_call> are tolerated
    ("<tool_call><function=search><parameter=limit>3<parameter=query>q</function>",
     None, [("search", {"limit": 3, "query": "q"})]),
    ("<tool_call>\n<function=noargs>\n</function>\n</tool_call> after", " after", [("noargs", {})]),
    ("No <tool calls> here", "No <tool calls> here", []),
])
def test_qwen3_xml(text, content, calls):
    r = check(QWEN3, text, tools=TOOLS)
    assert r.content == content and calls_of(r) == calls


def test_qwen3_xml_without_schema_keeps_strings():
    r = QWEN3().extract("<tool_call><function=search><parameter=limit>5</parameter></function></tool_call>")
    assert calls_of(r) == [("search", {"limit": "5"})]


@pytest.mark.parametrize("text,stream", [
    ("<tool_call>\n<function=search>\n<parameter=limit>\n5\n</parameter>\n", False),  # unterminated
    ("<tool_call>\nnot xml\n</tool_call>", True),
    ("<tool_call>\n<function=search", True),
])
def test_qwen3_xml_malformed(text, stream):
    r = check(QWEN3, text, tools=TOOLS, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- deepseek_v3

DSV3 = get_tool_parser("deepseek_v3")
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _v3(name, args):
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


@pytest.mark.parametrize("text,content,calls", [
    (B + _v3("get_weather", '{"city": "Paris"}') + E, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n\n" + B + _v3("a", NESTED_JSON) + "\n" + _v3("b", '{"s": "```' + CE + '"}') + E,
     "Let me look.\n\n", [("a", NESTED), ("b", {"s": "```" + CE})]),
    (B + f'{CB}get_weather{SEP}{{"city": "北京"}}{CE}' + E + " done", " done",
     [("get_weather", {"city": "北京"})]),  # V3.1 form
    (B + _v3("f", "{}"), None, [("f", {})]),  # missing calls-end at EOS
    ("Plain answer <｜tool", "Plain answer <｜tool", []),
])
def test_deepseek_v3(text, content, calls):
    r = check(DSV3, text)
    assert r.content == content and calls_of(r) == calls


@pytest.mark.parametrize("text,stream", [
    (B + f"{CB}function{SEP}f\n```json\n{{\"a\": ", False),
    (B + f"{CB}function{SEP}f\n```json\n[1]\n```{CE}" + E, False),
    (B + "garbage", True),
])
def test_deepseek_v3_malformed(text, stream):
    r = check(DSV3, text, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- granite

GRANITE = get_tool_parser("granite")


@pytest.mark.parametrize("text,content,calls", [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ('Ok <|tool_call|>[{"name": "a", "arguments": ' + NESTED_JSON + '}, {"name": "b", "arguments": '
     '{"s": "<|tool_call|>]"}}] bye', "Ok  bye", [("a", NESTED), ("b", {"s": "<|tool_call|>]"})]),
    ("no calls <|tool", "no calls <|tool", []),
])
def test_granite(text, content, calls):
    r = check(GRANITE, text)
    assert r.content == content and calls_of(r) == calls


@pytest.mark.parametrize("text,stream", [
    ('<|tool_call|>[{"name": "f", "arguments": {"a": 1}}', False),
    ("<|tool_call|>{oops}", True),
])
def test_granite_malformed(text, stream):
    r = check(GRANITE, text, stream=stream)
    assert not r.tools_called and r.content == text

# ----------------------------------------------------------------- phi4_mini_json

PHI4 = get_tool_parser("phi4_mini_json")


@pytest.mark.parametrize("text,content,calls", [
    ('functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check. functools [{"name": "a", "arguments": ' + NESTED_JSON + '},\n'
     ' {"name": "b", "parameters": {"s": "functools[{\\"name\\": 1}]"}}] ok',
     "Let me check.  ok", [("a", NESTED), ("b", {"s": 'functools[{"name": 1}]'})]),
    ('functools[{"name": "noargs"}, {"arguments": "{\\"x\\": 1}", "name": "s"}]', None,
     [("noargs", {}), ("s", {"x": 1})]),
    # the word alone is content; a later marker with a list still opens calls
    ('Use functools.partial, or functools [\n{"name": "f", "arguments": {"a": [1]}}]',
     "Use functools.partial, or ", [("f", {"a": [1]})]),
    ("import functools\nprint(functools.reduce)", "import functools\nprint(functools.reduce)",
     []),
    ("ends with the word functools", "ends with the word functools", []),
    ("no calls, just func", "no calls, just func", []),
])
def test_phi4_mini_json(text, content, calls):
    r = check(PHI4, text)
    assert r.content == content and calls_of(r) == calls and r.tools_called == bool(calls)


@pytest.mark.parametrize("text,stream", [
    ('functools[{"name": "f", "arguments": {"a": 1}}', False),  # list never closed
    ('functools[{"name": "f", "arguments": {"a": 1,}}]', False),  # bad JSON
    ('functools[{"name": "f", "arguments": [1]}]', False),  # arguments not an object
    ("functools[0]", True),  # e.g. code indexing something named functools
    ('functools[{"arguments": {}}]', True),  # no name
    ("functools[]", True),
    ("x = functools[", True),
])
def test_phi4_mini_json_malformed(text, stream):
    r = check(PHI4, text, stream=stream)
    assert not r.tools_called and r.tool_calls == [] and r.content == text


def test_phi4_mini_json_streams_arguments_incrementally():
    text = 'functools[{"name": "f", "arguments": {"city": "Paris", "days": 3}}, {"name": "g"}]'
    p = PHI4(id_factory=_ids())
    frags: dict[int, list[str]] = {0: [], 1: []}
    names = []
    for ch in text:
        d = p.extract_streaming(ch)
        assert d is None or d.content is None  # nothing of the marker or list leaks as content
        for tc in d.tool_calls if d else []:
            if tc.name:
                names.append(tc.name)
            if tc.arguments:
                frags[tc.index].append(tc.arguments)
    d = p.finish()
    assert d is None or d.content is None
    assert names == ["f", "g"] and len(frags[0]) > 5
    assert json.loads("".join(frags[0])) == {"city": "Paris", "days": 3}
    assert json.loads("".join(frags[1])) == {}

# ----------------------------------------------------------------- registry / auto


def test_registry():
    for name in ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_xml", "deepseek_v3", "granite",
                 "phi4_mini_json"):
        assert issubclass(TOOL_PARSERS[name], ToolParser)
        assert get_tool_parser(name).name
    with pytest.raises(KeyError):
        get_tool_parser("nope")


@pytest.mark.parametrize("template,name", [
    ("{% if tools %}<tool_call>\n{{ tool | tojson }}\n</tool_call>{% endif %}", "hermes"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_xml"),
    ("{{'<｜tool▁calls▁begin｜>'}}", "deepseek_v3"),
    ("<|start_of_role|>assistant<|end_of_role|><|tool_call|>", "granite"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("<|python_start|>{{ call }}<|python_end|>", "pythonic"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    # Phi-4-mini: vLLM's example template (asks for functools[...]) and the official one
    ("* all function calls should be generated in a single JSON list formatted as "
     "functools[{\"name\": [function name], \"arguments\": [function arguments as JSON]}, ...]",
     "phi4_mini_json"),
    ("{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
     "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
     "'<|/tool|>' + '<|end|>' }}", "phi4_mini_json"),
    # DeepSeek-V3.1: the same markers as V3; one parser reads both call forms
    ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
     "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek_v3"),
    # no call syntax: Gemma 3 (system folded into the first user turn), Phi-3, Mixtral-8x7B
    ("{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
     "messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
     "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}", None),
    ("{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}",
     None),
    ("{{ '[INST] ' + message['content'] + ' [/INST]' }}", None),
    # vLLM's Gemma 3 tool template asks for a python list of calls
    ("{{ '<start_of_turn>' + role + '\n' -}}{{- \"Example Format: [func_name1(params_name1="
     "params_value1, params_name2=params_value2...), func_name2(params)] \\n\" -}}"
     "{{ '<tool_response>\n' -}}", "pythonic"),
    ("import functools  # the word alone is not the marker", None),
    ("{{ messages }}", None),
    (None, None),
])
def test_auto(template, name):
    assert detect_tool_parser(template) == name
    cls = tool_parser_for_template(template)
    assert (cls is None) if name is None else (cls is TOOL_PARSERS[name])


def test_extract_never_raises_on_garbage():
    junk = ["<tool_call>{", "[TOOL_CALLS]\x00", "[f(a=", B + CB, "<|tool_call|>[{\"name\"", "{\"name\": \"\\",
            "[f(a=1e999999)]", "<tool_call><function=f><parameter=x>", "{" * 5000]
    for cls in set(TOOL_PARSERS.values()):
        for text in junk:
            r = cls().extract(text)
            assert isinstance(r.content, (str, type(None)))
            p = cls()
            for ch in text[:300]:
                p.extract_streaming(ch)
            p.finish()
