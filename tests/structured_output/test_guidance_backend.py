"""Tests for the llguidance ("guidance") structured-output backend (CPU, SmolLM2 tokenizer).

Generation drives the matcher with *random allowed tokens*: each step samples uniformly from
the ids the bitmask allows (seeded), which explores the grammar far more than argmax would.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from grammar_walk import allowed_ids, random_generate
from grammar_cases import BENCH, CHOICES, EBNF, EBNF_RE, PERSON_SCHEMA, REGEX
from folio.structured_output import (
    GrammarCompiler,
    GrammarMatcher,
    GuidanceCompiler,
    GuidanceMatcher,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_bitmask,
)

# Lark (llguidance's own syntax): a bounded list of words or numbers, then an inline JSON schema
# (compact via x-guidance: whitespace options don't reach %json inside a user's Lark grammar).
LARK = r"""
start: "[" item ("," item){0,3} "] -> " %json {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}
item: WORD | NUMBER
WORD: /[a-z]{1,5}/
NUMBER: /[0-9]{1,3}/
"""
LARK_RE = re.compile(r"\[([a-z]{1,5}|[0-9]{1,3})(,([a-z]{1,5}|[0-9]{1,3})){0,3}\] -> (.*)", re.S)


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size) -> GuidanceCompiler:
    # Compact JSON: with random tokens, free whitespace would loop.
    return GuidanceCompiler(tokenizer, vocab_size, any_whitespace=False)


def generate_text(compiler, tokenizer, vocab_size, params, seed) -> str:
    matcher = GuidanceMatcher(compiler.compile(params))
    tokens = random_generate(matcher, vocab_size, seed)
    assert tokens[-1] == tokenizer.eos_token_id
    return tokenizer.decode(tokens[:-1])


def accepts(matcher, tokenizer, text: str, *, finish: bool = True) -> bool:
    for tok in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(tok):
            return False
    return matcher.accept_token(tokenizer.eos_token_id) if finish else True


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_schema_generation_validates(compiler, tokenizer, vocab_size, seed):
    text = generate_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(json=PERSON_SCHEMA), seed)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    # No free whitespace (the compiler default is any_whitespace=False): only the fixed
    # separators ", " and ": ", as xgrammar writes them.
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_regex_generation_fullmatches(compiler, tokenizer, vocab_size, seed):
    text = generate_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(regex=REGEX), seed)
    # \d is ASCII (as in xgrammar), not Rust's Unicode \d.
    assert re.fullmatch(REGEX, text, re.ASCII), text


def test_regex_rust_syntax(compiler, tokenizer):
    # Unicode classes and inline flags (xgrammar rejects both).
    compiled = compiler.compile(StructuredOutputsParams(regex=r"(?i)abc\p{L}+"))
    assert accepts(GuidanceMatcher(compiled), tokenizer, "AbCé")
    assert not accepts(GuidanceMatcher(compiled), tokenizer, "abc1")


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_choice_generation_is_a_choice(compiler, tokenizer, vocab_size, seed):
    text = generate_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(choice=CHOICES), seed)
    assert text in CHOICES


def test_every_choice_is_reachable(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputsParams(choice=CHOICES + ["é日本", ""]))
    for choice in CHOICES + ["é日本", ""]:
        matcher = GuidanceMatcher(compiled)
        assert accepts(matcher, tokenizer, choice), choice
        assert matcher.is_terminated()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ebnf_generation_matches(compiler, tokenizer, vocab_size, seed):
    text = generate_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(grammar=EBNF), seed)
    assert re.fullmatch(EBNF_RE, text), text


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lark_generation_parses(compiler, tokenizer, vocab_size, seed):
    text = generate_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(grammar=LARK), seed)
    m = LARK_RE.fullmatch(text)
    assert m, text
    obj = json.loads(m.group(4))
    assert set(obj) == {"n"} and isinstance(obj["n"], int)


def test_json_object(compiler, tokenizer, vocab_size):
    compiled = compiler.compile(StructuredOutputsParams(json_object=True))
    matcher = GuidanceMatcher(compiled)
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask, 0, vocab_size)
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    assert accepts(matcher, tokenizer, '{"a": [1, 2], "b": {"c": null}}')
    assert not accepts(GuidanceMatcher(compiled), tokenizer, "[1,2]")


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
    cases = [
        (legacy, 'hi <f=get>{"a": 7}</f> bye', True),
        (legacy, "no call at all", True),
        (legacy, 'hi <f=get>{"a": 7}</f> then <f=get>{"a": 8}</f>', True),
        (legacy, 'hi <f=get>{"b": 7}</f>', False),
        (new, "Answer: 42", True),
        (new, "Answer: x", False),
    ]
    for spec, text, ok in cases:
        compiled = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(spec)))
        assert accepts(GuidanceMatcher(compiled), tokenizer, text) is ok, text


def test_structural_tag_tags(compiler, tokenizer):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tag = {"type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": schema}, "end": ["</call>", "</c>"]}
    triggered = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<call>"], "tags": [tag], "at_least_one": True}}
    separated = {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [tag], "separator": ",", "at_least_one": True}}
    text_tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}}
    cases = [
        (triggered, 'Sure. <call>{"x": 1}</c> done', True),
        (triggered, "no call", False),  # at_least_one
        (separated, '<call>{"x": 1}</call>,<call>{"x": 2}</c>', True),
        (separated, '<call>{"x": 1}</call> text', False),
        (text_tag, "<think>any thing\n at all</think>", True),
        (text_tag, "<think>a</think> more", False),  # any_text stops at the first end tag
    ]
    for spec, text, ok in cases:
        compiled = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(spec)))
        assert accepts(GuidanceMatcher(compiled), tokenizer, text) is ok, text


def test_structural_tag_unsupported_format(compiler):
    spec = {"type": "structural_tag", "format": {"type": "token", "token": 5}}
    with pytest.raises(ValueError, match=r"structural_tag.*guidance.*'token' is not supported"):
        compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(spec)))


def test_disallowed_token_rejected_state_unchanged(compiler, tokenizer, vocab_size):
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(choice=["red", "green"])))
    before = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(before, 0)
    assert not matcher.accept_token(tokenizer.encode("xyz", add_special_tokens=False)[0])
    assert not matcher.accept_token(tokenizer.eos_token_id)  # nothing generated yet
    assert not matcher.accept_token(vocab_size + 10)  # out of range: no llguidance error state
    assert not matcher.accept_token(-1)
    after = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.num_accepted == 0
    assert accepts(matcher, tokenizer, "green")  # still usable


def test_rollback_restores_state(compiler, tokenizer, vocab_size):
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(json=PERSON_SCHEMA)))
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
    assert matcher.validate_tokens(draft[:1] + [vocab_size + 5]) == draft[:1]
    matcher.fill_bitmask(restored, 0)
    assert torch.equal(snapshot, restored)

    with pytest.raises(ValueError):
        matcher.rollback(len(prefix) + 1)
    matcher.rollback(len(prefix))
    fresh = GuidanceMatcher(matcher.compiled)
    a, b = allocate_bitmask(1, vocab_size), allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(a, 0)
    fresh.fill_bitmask(b, 0)
    assert torch.equal(a, b)


def test_rollback_over_termination_and_reset(compiler, tokenizer, vocab_size):
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(choice=["red", "green"])))
    red = tokenizer.encode("red", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    # validate_tokens includes a stop token once the grammar is complete (llguidance itself
    # says 0 for EOS after a finished choice).
    assert matcher.validate_tokens(red + [eos, eos]) == red + [eos]
    assert accepts(matcher, tokenizer, "red")
    assert matcher.is_terminated() and matcher.validate_tokens([eos]) == []
    matcher.rollback(1)  # un-stop: back to "red" done, only the stop token allowed
    assert not matcher.is_terminated() and matcher.num_accepted == len(red)
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, vocab_size) == [eos]
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(len(red) + 1)  # all the way back, over the stop token
    fresh = allocate_bitmask(1, vocab_size)
    GuidanceMatcher(matcher.compiled).fill_bitmask(fresh, 0)
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, fresh)
    matcher.reset()
    assert matcher.num_accepted == 0 and not matcher.is_terminated()
    assert accepts(matcher, tokenizer, "green")


def test_rollback_over_stop_token_while_extensible(compiler, tokenizer, vocab_size):
    # "[a-z]+" can still grow when the stop token comes: llguidance records that stop token.
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(regex="[a-z]+")))
    assert accepts(matcher, tokenizer, "abc", finish=False)
    before = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(before, 0)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)
    after = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after) and len(allowed_ids(after, 0, vocab_size)) > 1000


def test_terminated_matcher_allows_only_stop(compiler, tokenizer, vocab_size):
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(choice=["red"])))
    assert accepts(matcher, tokenizer, "red")
    assert matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.eos_token_id)
    bitmask = allocate_bitmask(2, vocab_size)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, vocab_size)
    apply_bitmask(logits, bitmask, rows=[1])
    assert torch.nonzero(logits[1] == 0).flatten().tolist() == [tokenizer.eos_token_id]
    assert torch.all(logits[0] == 0)  # row 0 not in rows: untouched


def test_bitmask_wider_row_and_padded_vocab(tokenizer, vocab_size):
    # Model vocab padded beyond the tokenizer's: padding ids are never allowed.
    padded = vocab_size + 70
    compiler = GuidanceCompiler(tokenizer, padded)
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(regex="[a-z]+")))
    bitmask = allocate_bitmask(3, padded + 100)  # wider rows than needed
    matcher.fill_bitmask(bitmask, 2)
    ids = allowed_ids(bitmask, 2, padded + 100)
    assert ids and max(ids) < vocab_size
    assert torch.all(bitmask[0] == -1) and torch.all(bitmask[1] == -1)  # other rows untouched
    assert all(re.fullmatch(r"[a-z]+", tokenizer.decode([t])) for t in ids[:200])
    # A non-contiguous target row (a column slice) goes through a temporary.
    wide = allocate_bitmask(2, 2 * padded)
    view = wide[:, : bitmask.shape[1]]
    matcher.fill_bitmask(view, 0)
    assert allowed_ids(view, 0, padded + 100) == ids
    with pytest.raises(ValueError, match="too small"):
        matcher.fill_bitmask(allocate_bitmask(1, vocab_size), 0)


def test_custom_stop_token_ids(tokenizer, vocab_size):
    # SmolLM2-Instruct's eos is <|im_end|>; stop on <|endoftext|> instead.
    im_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(im_end, int) and im_end != tokenizer.eos_token_id
    compiler = GuidanceCompiler(tokenizer, vocab_size, stop_token_ids=[im_end])
    matcher = GuidanceMatcher(compiler.compile(StructuredOutputsParams(choice=["yes", "no"])))
    assert accepts(matcher, tokenizer, "yes", finish=False)
    assert not matcher.accept_token(tokenizer.eos_token_id)
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, vocab_size) == [im_end]
    assert matcher.accept_token(im_end) and matcher.is_terminated()


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(choice=["red", "green", "gray", "blue"]),
        StructuredOutputsParams(regex="[0-9]{3}"),
        StructuredOutputsParams(regex="(cat|dog)-[0-9]"),
    ],
)
def test_bitmask_matches_xgrammar(compiler, tokenizer, vocab_size, params):
    """Where the languages are identical, both backends must allow exactly the same tokens."""
    xgr_compiler = GrammarCompiler(tokenizer, vocab_size, any_whitespace=False)
    g = GuidanceMatcher(compiler.compile(params))
    x = GrammarMatcher(xgr_compiler.compile(params))
    rng = random.Random(0)
    mask_g, mask_x = allocate_bitmask(1, vocab_size), allocate_bitmask(1, vocab_size)
    steps = 0
    while not g.is_terminated():
        g.fill_bitmask(mask_g, 0)
        x.fill_bitmask(mask_x, 0)
        assert torch.equal(mask_g, mask_x), f"masks differ after {steps} tokens"
        token = rng.choice(allowed_ids(mask_g, 0, vocab_size))
        assert g.accept_token(token) and x.accept_token(token)
        steps += 1
    assert x.is_terminated() and steps >= 2


@pytest.mark.parametrize(
    "params, needle",
    [
        (StructuredOutputsParams(json={"type": 5}), "invalid json"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "invalid json"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(json=False), "invalid json"),
        (StructuredOutputsParams(regex="[a-"), "invalid regex"),
        (StructuredOutputsParams(regex="a(b"), "invalid regex"),
        (StructuredOutputsParams(regex="a(?=b)"), "invalid regex"),
        (StructuredOutputsParams(grammar='root ::= "a" "'), "invalid grammar"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "invalid grammar"),  # no root rule
        (StructuredOutputsParams(grammar='root ::= (= "a") "a"'), "xgrammar-only EBNF"),
        (StructuredOutputsParams(grammar='start: "a" missing_rule'), "invalid grammar"),
        (StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "bogus"}}'), "structural_tag"),
        (StructuredOutputsParams(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "structural_tag"),
        (StructuredOutputsParams(structural_tag='{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}'), "structural_tag"),
        (StructuredOutputsParams(json_object=True, whitespace_pattern="[ "), "invalid json_object"),
    ],
)
def test_invalid_constraints_raise_value_error(compiler, params, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        compiler.compile(params)
    assert "guidance" in str(info.value)
    assert "<state>" not in str(info.value)


def test_whitespace_options(tokenizer, vocab_size):
    compiler = GuidanceCompiler(tokenizer, vocab_size)  # any_whitespace=True, vLLM's default
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    loose = compiler.compile(StructuredOutputsParams(json=schema))
    compact = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    one_space = compiler.compile(StructuredOutputsParams(json=schema, whitespace_pattern="[ ]?"))
    assert len({id(loose), id(compact), id(one_space)}) == 3  # options are in the cache key
    texts = ['{"a":1}', '{"a": 1}', '{ "a" :  1 }', '{\n  "a": 1\n}']
    assert [accepts(GuidanceMatcher(loose), tokenizer, t) for t in texts] == [True, True, True, True]
    # Compact = xgrammar's form: exactly ", " and ": " between tokens.
    assert [accepts(GuidanceMatcher(compact), tokenizer, t) for t in texts] == [False, True, False, False]
    assert [accepts(GuidanceMatcher(one_space), tokenizer, t) for t in texts] == [True, True, False, False]


def test_disable_additional_properties(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    plain = compiler.compile(StructuredOutputsParams(json=schema))
    strict = compiler.compile(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    assert accepts(GuidanceMatcher(plain), tokenizer, '{"a": 1, "z": 2}')  # JSON Schema default
    assert not accepts(GuidanceMatcher(strict), tokenizer, '{"a": 1, "z": 2}')
    assert not accepts(GuidanceMatcher(strict), tokenizer, '{"o": {"b": 1, "z": 2}}')  # nested too
    assert accepts(GuidanceMatcher(strict), tokenizer, '{"a": 1, "o": {"b": 2}}')


def test_cache(tokenizer, vocab_size):
    compiler = GuidanceCompiler(tokenizer, vocab_size, cache_entries=2)
    schema = {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "number"}}}}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    second = compiler.compile(StructuredOutputsParams(json=json.dumps(schema, indent=2)))
    assert second is first and (compiler.cache_hits, compiler.cache_misses) == (1, 1)
    compiler.compile(StructuredOutputsParams(regex="a"))
    compiler.compile(StructuredOutputsParams(regex="b"))  # evicts the schema (LRU, 2 entries)
    assert compiler.cache_size() == 2
    assert compiler.compile(StructuredOutputsParams(json=schema)) is not first
    assert compiler.cache_misses == 4


def test_jsonschemabench_first_10_compile_once(tokenizer, vocab_size):
    # Compile times are measured by `python -m folio.bench.structured_bench`, not here.
    compiler = GuidanceCompiler(tokenizer, vocab_size)
    rows = [json.loads(line) for line in BENCH.read_text().splitlines()[:10]]
    compiled_ids, failures = [], []
    for row in rows:
        params = StructuredOutputsParams(json=row["schema"])
        try:
            compiled = compiler.compile(params)
        except ValueError as e:
            failures.append((row["id"], str(e)[:120]))
            continue
        assert compiler.compile(params) is compiled
        compiled_ids.append(row["id"])
    print(f"\nguidance jsonschemabench first 10: compiled {len(compiled_ids)}, failed {len(failures)} {failures}")
    assert len(compiled_ids) + len(failures) == 10 and len(compiled_ids) >= 5
    assert compiler.cache_hits == len(compiled_ids)
    assert all(f.startswith("invalid json for structured output (guidance backend)") for _, f in failures)
