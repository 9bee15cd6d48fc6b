"""Tests for StructuredOutputCompiler: backend choice (auto / xgrammar / guidance), fallback,
caching, and the request options (whitespace, additional properties, fallback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest

from grammar_walk import random_generate
from folio.structured_output import (
    BACKENDS,
    CompiledConstraint,
    GrammarMatcher,
    GuidanceMatcher,
    StructuredOutputCompiler,
    StructuredOutputsParams,
    disallow_additional_properties,
    is_lark_grammar,
)

REPO = Path(__file__).resolve().parents[2]
LARK = 'start: "(" expr ")"\nexpr: DIGIT | DIGIT "+" expr\nDIGIT: /[0-9]/\n'
EBNF = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
# Valid in llguidance's (Rust) regex syntax, rejected by xgrammar: Unicode class, inline flag.
XGR_REJECTS_REGEX = r"(?i)ok-\p{L}{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {
        # Bounded by patterns, not maxLength: `auto` sends length-bounded strings to guidance
        # (json_features.py), and these tests want a schema xgrammar takes first.
        "name": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                 "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def auto(tokenizer, vocab_size) -> StructuredOutputCompiler:
    return StructuredOutputCompiler(tokenizer, vocab_size)


def accepts(matcher, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)


def random_text(matcher, tokenizer, vocab_size: int, seed: int, max_steps: int = 300) -> str:
    """Sample uniformly among the allowed tokens until the stop token; the text before it."""
    return tokenizer.decode(random_generate(matcher, vocab_size, seed, max_steps)[:-1])


def counting(monkeypatch, compiler: StructuredOutputCompiler, name: str, fail: str | None = None):
    """Wrap a backend's compile to count calls (and optionally fail with ValueError)."""
    backend = compiler.get_backend(name)
    calls = []
    original = backend.compile

    def compile(params):
        calls.append(params)
        if fail is not None:
            raise ValueError(fail)
        return original(params)

    monkeypatch.setattr(backend, "compile", compile)
    return calls


def test_unknown_backend(tokenizer, vocab_size):
    with pytest.raises(ValueError, match=r"unknown structured output backend 'outlines'.*'auto', 'xgrammar', 'guidance'"):
        StructuredOutputCompiler(tokenizer, vocab_size, "outlines")
    assert BACKENDS == ("auto", "xgrammar", "guidance")


def test_backends_are_lazy_and_llguidance_not_imported():
    # A fresh interpreter: an auto compiler that only sees xgrammar-compatible constraints
    # never imports llguidance.
    code = (
        "import sys, transformers\n"
        "from folio.model.default_model import default_model_path\n"
        "from folio.structured_output import StructuredOutputCompiler, StructuredOutputsParams\n"
        "c = StructuredOutputCompiler(transformers.AutoTokenizer.from_pretrained(default_model_path()), 49152)\n"
        "before = c.loaded_backends()\n"
        "compiled = c.compile(StructuredOutputsParams(regex='[0-9]+'))\n"
        "print(before, c.loaded_backends(), compiled.backend, 'llguidance' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] ['xgrammar'] xgrammar False"


def test_auto_uses_xgrammar_for_ordinary_constraints(auto, tokenizer):
    for params in [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex="[0-9]{3}"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar=EBNF),
        StructuredOutputsParams(json_object=True),
    ]:
        compiled = auto.compile(params)
        assert isinstance(compiled, CompiledConstraint)
        assert compiled.backend == "xgrammar" and compiled.fallback_reason is None
        assert isinstance(auto.new_matcher(compiled), GrammarMatcher)
    assert accepts(auto.new_matcher(auto.compile(StructuredOutputsParams(grammar=EBNF))), tokenizer, "(1+2)")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_falls_back_to_guidance(auto, tokenizer, vocab_size, seed):
    compiled = auto.compile(StructuredOutputsParams(regex=XGR_REJECTS_REGEX))
    assert compiled.backend == "guidance"
    assert "invalid regex" in compiled.fallback_reason and "not supported" in compiled.fallback_reason
    matcher = auto.new_matcher(compiled)
    assert isinstance(matcher, GuidanceMatcher)
    text = random_text(matcher, tokenizer, vocab_size, seed)
    assert re.fullmatch(r"(?i)ok-[^\W\d_]{2,4}", text), text


def test_auto_fallback_for_schema_xgrammar_rejects(auto, tokenizer):
    # xgrammar (strict mode) can't satisfy minProperties without additionalProperties.
    schema = {"type": "object", "minProperties": 2}
    compiled = auto.compile(StructuredOutputsParams(json=schema))
    assert compiled.backend == "guidance" and "minProperties" in compiled.fallback_reason
    assert accepts(auto.new_matcher(compiled), tokenizer, '{"a":1,"b":[true]}')
    assert not accepts(auto.new_matcher(compiled), tokenizer, '{"a":1}')


def test_auto_routes_length_bounded_strings_to_guidance(auto, tokenizer):
    # xgrammar 0.2.9 lets raw control characters into maxLength strings (invalid JSON).
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
               "required": ["s"]}
    compiled = auto.compile(StructuredOutputsParams(json=bounded))
    assert compiled.backend == "guidance" and "length-bounded" in compiled.fallback_reason
    assert accepts(auto.new_matcher(compiled), tokenizer, '{"s": "ab"}')
    assert not accepts(auto.new_matcher(compiled), tokenizer, '{"s": "a\tb"}')
    assert not accepts(auto.new_matcher(compiled), tokenizer, '{"s": "abcdef"}')


def test_auto_fallback_simulated(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    xgr_calls = counting(monkeypatch, compiler, "xgrammar", fail="invalid json for structured output: boom")
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    compiled = compiler.compile(params)
    assert compiled.backend == "guidance" and compiled.fallback_reason.endswith("boom")
    assert compiler.fallbacks == 1 and len(xgr_calls) == 1
    text = random_text(compiler.new_matcher(compiled), tokenizer, vocab_size, seed=0)
    jsonschema.validate(json.loads(text), SCHEMA)
    # Cached: neither backend is asked again.
    assert compiler.compile(params) is compiled and len(xgr_calls) == 1


def test_disable_fallback(auto):
    params = StructuredOutputsParams(regex=XGR_REJECTS_REGEX, disable_fallback=True)
    with pytest.raises(ValueError) as info:
        auto.compile(params)
    message = str(info.value)
    assert message.startswith("invalid regex for structured output:")
    assert "not supported" in message and "disable_fallback" in message
    assert "guidance backend" not in message  # guidance was not tried


def test_both_backends_fail(auto):
    with pytest.raises(ValueError) as info:
        auto.compile(StructuredOutputsParams(regex="a(?=b)"))  # lookahead: neither supports it
    message = str(info.value)
    # xgrammar's message first, then guidance's.
    assert message.startswith("invalid regex for structured output: Regex parsing error")
    assert "Lookahead is not supported" in message
    assert "guidance fallback also failed: invalid regex for structured output (guidance backend)" in message
    with pytest.raises(ValueError, match=r"^invalid json for structured output: .*guidance fallback also failed"):
        auto.compile(StructuredOutputsParams(json={"type": 5}))


def test_lark_goes_to_guidance(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    compiled = compiler.compile(StructuredOutputsParams(grammar=LARK))
    assert compiled.backend == "guidance" and compiled.fallback_reason == "Lark grammar"
    assert compiler.loaded_backends() == ["guidance"]  # xgrammar never built
    for seed in range(3):
        text = random_text(compiler.new_matcher(compiled), tokenizer, vocab_size, seed)
        assert re.fullmatch(r"\(\d(\+\d)*\)", text), text
    # An invalid Lark grammar is not sent to xgrammar either.
    with pytest.raises(ValueError, match=r"^invalid grammar for structured output \(guidance backend\): .*unknown name"):
        compiler.compile(StructuredOutputsParams(grammar="start: foo\n"))
    assert compiler.loaded_backends() == ["guidance"]


def test_explicit_backends(tokenizer, vocab_size):
    xgr = StructuredOutputCompiler(tokenizer, vocab_size, "xgrammar")
    with pytest.raises(ValueError, match=r"invalid grammar.*looks like a Lark grammar"):
        xgr.compile(StructuredOutputsParams(grammar=LARK))
    with pytest.raises(ValueError, match=r"invalid regex.*not supported") as info:
        xgr.compile(StructuredOutputsParams(regex=XGR_REJECTS_REGEX))  # no fallback
    assert "guidance" not in str(info.value)
    with pytest.raises(ValueError, match="whitespace_pattern is not supported by the xgrammar backend"):
        xgr.compile(StructuredOutputsParams(json_object=True, whitespace_pattern=r"[ ]?"))
    assert xgr.loaded_backends() == ["xgrammar"]

    guidance = StructuredOutputCompiler(tokenizer, vocab_size, "guidance")
    for params in [StructuredOutputsParams(grammar=EBNF), StructuredOutputsParams(json=SCHEMA)]:
        compiled = guidance.compile(params)
        assert compiled.backend == "guidance" and compiled.fallback_reason is None
    assert guidance.loaded_backends() == ["guidance"]


def test_whitespace_pattern_routes_to_guidance(auto, tokenizer):
    compiled = auto.compile(StructuredOutputsParams(json_object=True, whitespace_pattern=r"[ ]?"))
    assert compiled.backend == "guidance" and compiled.fallback_reason == "whitespace_pattern"
    assert accepts(auto.new_matcher(compiled), tokenizer, '{"a": 1}')
    assert not accepts(auto.new_matcher(compiled), tokenizer, '{"a":\n1}')


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_disable_any_whitespace(tokenizer, vocab_size, backend):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size, backend)
    loose = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    compact = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert loose is not compact and loose.key != compact.key
    for spaced in ['{ "name":"x",\n"n":1, "tags":[ "a" ] }', '{"name":"x","n":1,"tags":["a"]}']:
        assert accepts(compiler.new_matcher(loose), tokenizer, spaced)  # default: free whitespace
        assert not accepts(compiler.new_matcher(compact), tokenizer, spaced)
    for seed in range(3):
        text = random_text(compiler.new_matcher(compact), tokenizer, vocab_size, seed)
        obj = json.loads(text)
        jsonschema.validate(obj, SCHEMA)
        # No free whitespace outside strings: only the fixed separators ", " and ": " that
        # xgrammar uses (guidance is configured to match).
        skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), text
        assert not re.search(r"[,:](?! )", skeleton), text


def test_disable_additional_properties(tokenizer, vocab_size):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = '{"a":1,"b":2}'
    guidance = StructuredOutputCompiler(tokenizer, vocab_size, "guidance")
    plain = guidance.compile(StructuredOutputsParams(json=schema))
    strict = guidance.compile(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    assert accepts(guidance.new_matcher(plain), tokenizer, extra)
    assert not accepts(guidance.new_matcher(strict), tokenizer, extra)
    assert accepts(guidance.new_matcher(strict), tokenizer, '{"a":1}')
    # xgrammar's strict mode (vLLM's setting) rejects undeclared properties either way.
    xgr = StructuredOutputCompiler(tokenizer, vocab_size, "xgrammar")
    for flag in (False, True):
        compiled = xgr.compile(StructuredOutputsParams(json=schema, disable_additional_properties=flag))
        assert not accepts(xgr.new_matcher(compiled), tokenizer, extra)
        assert accepts(xgr.new_matcher(compiled), tokenizer, '{"a":1}')


def test_cache_hits_do_not_recompile(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    xgr_calls = counting(monkeypatch, compiler, "xgrammar")
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=1)))
    assert again is first and len(xgr_calls) == 1
    assert (compiler.cache_hits, compiler.cache_misses) == (1, 1)
    # Same schema, different option: a different compiled grammar.
    other = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert other is not first and len(xgr_calls) == 2
    assert (compiler.cache_hits, compiler.cache_misses) == (1, 2)
    assert compiler.cache_size() == 2
    # Matchers from one compiled constraint are independent.
    m1, m2 = compiler.new_matcher(first), compiler.new_matcher(first)
    assert m1.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    assert m1.num_accepted == 1 and m2.num_accepted == 0


def test_concurrent_compiles_of_one_constraint_compile_once(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    backend = compiler.get_backend("xgrammar")
    original = backend.compile
    calls = []

    def slow_compile(params):
        calls.append(params)
        time.sleep(0.3)
        return original(params)

    monkeypatch.setattr(backend, "compile", slow_compile)
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(compiler.compile(StructuredOutputsParams(regex="[a-c]{2}"))))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4
    assert all(r is results[0] for r in results)
    assert (compiler.cache_hits, compiler.cache_misses) == (3, 1)


def test_failed_compile_is_not_cached(auto):
    params = StructuredOutputsParams(regex="a(b", disable_fallback=True)
    misses = auto.cache_misses
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid regex"):
            auto.compile(params)
    assert auto.cache_misses == misses + 2


def test_bad_inputs(auto):
    with pytest.raises(ValueError, match="expected StructuredOutputsParams"):
        auto.compile({"json": {}})
    with pytest.raises(ValueError, match="expected CompiledConstraint"):
        auto.new_matcher("not compiled")
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        auto.compile(StructuredOutputsParams(regex="a", disable_any_whitespace="yes"))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
        ({"disable_fallback": 1}, "disable_fallback must be a bool"),
        ({"disable_additional_properties": None}, "disable_additional_properties must be a bool"),
        ({"whitespace_pattern": 5}, "whitespace_pattern must be a str"),
        ({"whitespace_pattern": ""}, "whitespace_pattern must be a non-empty"),
        ({"whitespace_pattern": " ", "disable_any_whitespace": True}, "whitespace_pattern and disable_any_whitespace"),
    ],
)
def test_validate_names_option(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(json={"type": "object"}, **kwargs).validate()


def test_key_includes_options():
    base = StructuredOutputsParams(json={"type": "object"})
    assert base.key() == ("json", '{"type":"object"}')  # defaults: key unchanged
    keys = {
        base.key(),
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True).key(),
        StructuredOutputsParams(json={"type": "object"}, disable_fallback=True).key(),
        StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True).key(),
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" ").key(),
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern="  ").key(),
    }
    assert len(keys) == 6  # all distinct, all hashable
    key = StructuredOutputsParams(regex="a", disable_any_whitespace=True, disable_fallback=True).key()
    assert key == ("regex", "a", (("disable_any_whitespace", True), ("disable_fallback", True)))
    assert hash(key) == hash(StructuredOutputsParams(regex="a", disable_fallback=True, disable_any_whitespace=True).key())


@pytest.mark.parametrize(
    "text, lark",
    [
        (LARK, True),
        ('start: "a"', True),
        ("?value: dict | list\nstart: value", True),
        ('%llguidance {}\nstart: "x"', True),
        ("NUMBER.2: /[0-9]+/\nstart: NUMBER", True),
        (EBNF, False),
        ('root ::= "a:b"', False),
        ('start ::= "a"', False),
        ('root ::= item\nitem ::= "x"  # a: comment', False),
        ('"just a string"', False),
    ],
)
def test_is_lark_grammar(text, lark):
    assert is_lark_grammar(text) is lark


def test_disallow_additional_properties():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},  # a property named "properties"
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
        },
        "$defs": {"d": {"type": ["object", "null"]}},
        "anyOf": [{"type": "object"}, {"type": "string"}],
    }
    out = disallow_additional_properties(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"] == {"type": "string"}
    assert "additionalProperties" not in out["properties"]  # not mistaken for a schema
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True  # explicit wins
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in out["anyOf"][1]
    assert "additionalProperties" not in schema  # input not modified
