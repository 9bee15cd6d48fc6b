"""Tests for the xgrammar structured-output backend (CPU, SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from grammar_cases import BENCH, CHOICES, EBNF, EBNF_RE, MAX_STEPS, PERSON_SCHEMA, REGEX
from folio.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask,
)


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size) -> GrammarCompiler:
    # Compact JSON: with random logits, any_whitespace=True loops on whitespace.
    return GrammarCompiler(tokenizer, vocab_size, any_whitespace=False)


def greedy_generate(matcher: GrammarMatcher, vocab_size: int, seed: int) -> list[int]:
    """Fake model: random logits -> mask -> argmax -> accept, until the stop token."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, vocab_size, generator=gen)
        apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token), f"masked argmax {token} was rejected"
        tokens.append(token)
    assert matcher.is_terminated(), f"no termination within {MAX_STEPS} tokens"
    return tokens


def decode_without_stop(tokenizer, tokens: list[int]) -> str:
    # The last accepted token is the stop (EOS) token.
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_generation_validates(compiler, tokenizer, vocab_size, seed):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(json=PERSON_SCHEMA)))
    text = decode_without_stop(tokenizer, greedy_generate(matcher, vocab_size, seed))
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_generation_fullmatches(compiler, tokenizer, vocab_size, seed):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(regex=REGEX)))
    text = decode_without_stop(tokenizer, greedy_generate(matcher, vocab_size, seed))
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_choice_generation_is_a_choice(compiler, tokenizer, vocab_size, seed):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=CHOICES)))
    text = decode_without_stop(tokenizer, greedy_generate(matcher, vocab_size, seed))
    assert text in CHOICES


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ebnf_generation_matches(compiler, tokenizer, vocab_size, seed):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(grammar=EBNF)))
    text = decode_without_stop(tokenizer, greedy_generate(matcher, vocab_size, seed))
    assert re.fullmatch(EBNF_RE, text), text


def test_every_choice_is_reachable(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputsParams(choice=CHOICES))
    for choice in CHOICES:
        matcher = GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in tokenizer.encode(choice, add_special_tokens=False))
        assert matcher.accept_token(tokenizer.eos_token_id)
        assert matcher.is_terminated()


def test_json_object_starts_with_brace(compiler, tokenizer, vocab_size):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(json_object=True)))
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    apply_bitmask(logits, bitmask)
    allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    for tok in tokenizer.encode('{"a": [1, 2]}', add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.accept_token(tokenizer.eos_token_id)


def test_disallowed_token_rejected_state_unchanged(compiler, tokenizer, vocab_size):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=["red", "green"])))
    before = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(before, 0)
    bad = tokenizer.encode("xyz", add_special_tokens=False)[0]
    assert not matcher.accept_token(bad)
    assert not matcher.accept_token(tokenizer.eos_token_id)  # nothing generated yet
    assert not matcher.accept_token(vocab_size + 10)  # out of range
    after = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.num_accepted == 0


def test_rollback_restores_state(compiler, tokenizer, vocab_size):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(json=PERSON_SCHEMA)))
    prefix = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in prefix)
    snapshot = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(snapshot, 0)

    draft = tokenizer.encode('ice", "age": 3', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in draft)
    matcher.rollback(len(draft))
    restored = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(restored, 0)
    assert torch.equal(snapshot, restored)
    assert matcher.num_accepted == len(prefix)

    # validate_tokens reports the allowed prefix without moving the state.
    bad_draft = draft[:2] + tokenizer.encode("}}}", add_special_tokens=False)
    assert matcher.validate_tokens(bad_draft) == draft[:2]
    matcher.fill_bitmask(restored, 0)
    assert torch.equal(snapshot, restored)

    with pytest.raises(ValueError):
        matcher.rollback(len(prefix) + 1)
    matcher.rollback(len(prefix))
    fresh = GrammarMatcher(matcher.compiled)
    a, b = allocate_bitmask(1, vocab_size), allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(a, 0)
    fresh.fill_bitmask(b, 0)
    assert torch.equal(a, b)


def test_terminated_matcher_allows_only_stop(compiler, tokenizer, vocab_size):
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=["red"])))
    for tok in tokenizer.encode("red", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.eos_token_id)
    bitmask = allocate_bitmask(2, vocab_size)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, vocab_size)
    apply_bitmask(logits, bitmask, rows=[1])
    assert torch.nonzero(logits[1] == 0).flatten().tolist() == [tokenizer.eos_token_id]
    assert torch.all(logits[0] == 0)  # row 0 not in rows: untouched


def test_terminated_matcher_refuses_quietly(compiler, tokenizer, capfd):
    """A draft after a drafted stop token (a verify step's mask rows) is refused without
    xgrammar's warning, in accept_token and in validate_tokens."""
    matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(choice=["red"])))
    red = tokenizer.encode("red", add_special_tokens=False)
    assert matcher.validate_tokens(red + [tokenizer.eos_token_id, 198]) == \
        red + [tokenizer.eos_token_id]
    for tok in red + [tokenizer.eos_token_id]:
        assert matcher.accept_token(tok)
    capfd.readouterr()
    assert not matcher.accept_token(198)
    assert matcher.validate_tokens([198]) == []
    assert "terminated" not in capfd.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_bitmask_rows_and_dtypes(dtype):
    vocab = 100  # not a multiple of 32
    bitmask = allocate_bitmask(3, vocab)
    assert bitmask.shape == (3, 4) and bitmask.dtype == torch.int32
    bitmask[:, :] = 0
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[2, 3] = 1 << 3  # token 99
    logits = torch.zeros(3, vocab, dtype=dtype)
    apply_bitmask(logits, bitmask, rows=[0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.all(logits[1] == 0)
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [99]


def counting_compiles(monkeypatch, compiler: GrammarCompiler) -> list[str]:
    """The kinds xgrammar was asked to compile (cache hits never reach it)."""
    calls: list[str] = []
    real = compiler._compile_uncached

    def compile_uncached(kind, params):
        calls.append(kind)
        return real(kind, params)

    monkeypatch.setattr(compiler, "_compile_uncached", compile_uncached)
    return calls


def test_cache_hit_does_not_recompile(tokenizer, vocab_size, monkeypatch):
    compiler = GrammarCompiler(tokenizer, vocab_size, any_whitespace=False)
    compiles = counting_compiles(monkeypatch, compiler)
    schema = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number"}}}}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    # Same schema as differently-formatted JSON text -> same key -> cache hit.
    second = compiler.compile(StructuredOutputsParams(json=json.dumps(schema, indent=2)))
    assert second is first
    assert compiles == ["json"]
    assert (compiler.cache_hits, compiler.cache_misses, compiler.cache_size()) == (1, 1, 1)


@pytest.mark.parametrize(
    "params, needle",
    [
        (StructuredOutputsParams(json={"type": 5}), "json"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json"),
        (StructuredOutputsParams(regex="[a-"), "regex"),
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(grammar="root ::= "), "grammar"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "grammar"),  # no root rule
        (StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "bogus"}}'), "structural_tag"),
    ],
)
def test_invalid_constraints_raise_value_error(compiler, params, needle):
    with pytest.raises(ValueError, match=needle) as info:
        compiler.compile(params)
    assert "/project/cpp" not in str(info.value)  # C++ log prefix stripped


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "none"),
        ({"json": {"type": "object"}, "regex": "a"}, "json, regex"),
        ({"json": 5}, "json"),
        ({"json": "{not json"}, "json"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": 3}, "regex"),
        ({"regex": ""}, "regex"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"choice": "abc"}, "choice"),
        ({"grammar": b"root"}, "grammar"),
        ({"structural_tag": "{"}, "structural_tag"),
        ({"structural_tag": "[1]"}, "structural_tag"),
    ],
)
def test_validate_names_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs).validate()


def test_key_is_canonical():
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputsParams(json='{ "a": {"type":"string"},  "b": 1 }')
    assert a.key() == b.key() and a.key()[0] == "json"
    assert StructuredOutputsParams(choice=["x", "y"]).key() != StructuredOutputsParams(choice=["y", "x"]).key()
    assert StructuredOutputsParams(json_object=True).key() == ("json_object", "")
    assert StructuredOutputsParams(regex="a+").key() == ("regex", "a+")


def test_structural_tag_both_formats(compiler, tokenizer):
    legacy = {
        "structures": [{"begin": "<f=get>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "end": "</f>"}],
        "triggers": ["<f="],
    }
    new = {
        "type": "structural_tag",
        "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "Answer: "},
            {"type": "json_schema", "json_schema": {"type": "integer"}},
        ]},
    }
    for spec, text in [(legacy, 'hi <f=get>{"a": 7}</f> bye'), (new, "Answer: 42")]:
        matcher = GrammarMatcher(compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(spec))))
        for tok in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(tok), text
        assert matcher.accept_token(tokenizer.eos_token_id)


def test_jsonschemabench_first_10_compile_once(tokenizer, vocab_size, monkeypatch):
    # Default (vLLM-like) settings; a fresh compiler so its cache starts empty. Compile
    # times are measured by `python -m folio.bench.structured_bench`, not here.
    compiler = GrammarCompiler(tokenizer, vocab_size)
    compiles = counting_compiles(monkeypatch, compiler)
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()[:10]]
    compiled, failures = [], []
    for row in rows:
        params = StructuredOutputsParams(json=row["schema"])
        try:
            first = compiler.compile(params)
        except ValueError as e:
            failures.append((row["id"], str(e)[:120]))
            continue
        assert compiler.compile(params) is first
        compiled.append(row["id"])
    print(f"\njsonschemabench first 10: compiled {len(compiled)}, failed {len(failures)} {failures}")
    assert len(compiled) + len(failures) == 10
    # Every schema reached xgrammar exactly once: each second compile was a cache hit.
    assert len(compiles) == compiler.cache_misses == 10
    assert compiler.cache_hits == len(compiled)
