"""No silent weakening of a constraint: a JSON schema that no backend fully enforces is a
ValueError naming the keyword, unless the request sets best_effort (then the route is
`partial` and says what is not enforced); each fallback is counted in the metrics by reason."""
from __future__ import annotations

import json

import jsonschema
import pytest

from folio.entrypoints.openai import request_constraints
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from folio.metrics.prometheus import STRUCTURED_OUTPUT_FALLBACK_REASONS, EngineMetrics
from folio.structured_output import validation
from folio.structured_output.compilers import (
    FALLBACK_REASONS,
    StructuredOutputCompiler,
    choose_backend,
)
from folio.structured_output.json_features import xgrammar_unenforced_features
from folio.structured_output.params import StructuredOutputsParams as SO
from folio.structured_output.validation import validate_constraint

from grammar_cases import BENCH

# tests/gpu/test_gpu_structured.py's schema: an allOf xgrammar compiles keeping one entry.
ALL_OF = {"type": "object",
          "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
          "allOf": [{"required": ["unit"]}, {"required": ["days"]}]}
# What an older llguidance said about it (simulated): guidance rejects, xgrammar would not
# enforce it either.
GUIDANCE_REJECTS = "invalid json for structured output (guidance backend): boom"


def _o89710() -> dict:
    for line in BENCH.read_text().splitlines():
        row = json.loads(line)
        if row["id"] == "Github_easy---o89710":
            return row["schema"]
    raise AssertionError("Github_easy---o89710 not in the sample")


@pytest.fixture
def guidance_rejects(monkeypatch):
    """The front end's guidance check rejects everything (strict and lenient)."""
    calls = []

    def check(params, lenient=False):
        calls.append(lenient)
        raise ValueError(GUIDANCE_REJECTS)
    monkeypatch.setattr(validation, "_check_guidance", check)
    return calls


@pytest.fixture
def xgrammar_calls(monkeypatch):
    calls = []
    original = validation._check_xgrammar

    def check(params):
        calls.append(params)
        return original(params)
    monkeypatch.setattr(validation, "_check_xgrammar", check)
    return calls


# ---- refusals --------------------------------------------------------------------------

def test_guidance_rejecting_an_unenforced_feature_is_refused_not_sent_to_xgrammar(
        guidance_rejects, xgrammar_calls):
    assert choose_backend(SO(json=ALL_OF), "auto")[0] == "guidance"
    with pytest.raises(ValueError) as info:
        validate_constraint(SO(json=ALL_OF), "auto")
    message = str(info.value)
    assert message.startswith("no backend enforces every keyword of this JSON schema (`allOf`)")
    assert "boom" in message and "best_effort" in message
    assert xgrammar_calls == []  # no silent xgrammar fallback
    assert guidance_rejects == [False]  # strict only: lenient needs best_effort


def test_compiler_refuses_too(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    xgr = compiler.get_backend("xgrammar")
    monkeypatch.setattr(compiler.get_backend("guidance"), "compile",
                        lambda params, lenient=False: (_ for _ in ()).throw(
                            ValueError(GUIDANCE_REJECTS)))
    monkeypatch.setattr(xgr, "compile", lambda params: pytest.fail("fell back to xgrammar"))
    with pytest.raises(ValueError, match=r"no backend enforces .*\(`allOf`\)"):
        compiler.compile(SO(json=ALL_OF))


def test_o89710_is_refused_naming_oneOf(tokenizer, vocab_size):
    # allOf sends it to guidance; llguidance (strict) can't prove its oneOfs exclusive, and
    # xgrammar would drop all but one allOf entry (its outputs lacked the required `to`).
    schema = _o89710()
    assert choose_backend(SO(json=schema), "auto")[0] == "guidance"
    with pytest.raises(ValueError, match=r"no backend enforces .*\(`oneOf`\): guidance rejects"):
        validate_constraint(SO(json=schema), "auto")
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    with pytest.raises(ValueError, match=r"\(`oneOf`\)"):
        compiler.compile(SO(json=schema))
    assert "xgrammar" not in compiler.loaded_backends()


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, "oneOf"),
])
def test_keywords_xgrammar_ignores_and_guidance_lacks_are_refused(schema, keyword):
    # Before: xgrammar compiled these without enforcing the keyword.
    assert choose_backend(SO(json=schema), "auto")[0] == "guidance"
    with pytest.raises(ValueError, match=rf"no backend enforces .*`{keyword}`"):
        validate_constraint(SO(json=schema), "auto")
    with pytest.raises(ValueError, match=rf"xgrammar backend does not enforce `{keyword}`"):
        validate_constraint(SO(json=schema), "xgrammar")
    route = validate_constraint(SO(json=schema, best_effort=True), "auto")
    assert route.partial and route.fallback_reason_code == "best_effort_partial"


def test_guidance_is_strict_whatever_the_schema_says():
    # A schema's own x-guidance cannot turn llguidance lenient (silently ignoring keywords).
    schema = {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}
    with pytest.raises(ValueError, match=r"guidance backend does not enforce .*`uniqueItems`"):
        validate_constraint(SO(json=schema), "guidance")
    coerce = {"x-guidance": {"coerce_one_of": True},
              "oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(ValueError, match="`oneOf`"):
        validate_constraint(SO(json=coerce), "guidance")


def test_disjoint_oneOf_is_enforced_by_guidance(tokenizer, vocab_size):
    schema = {"oneOf": [{"type": "string", "enum": ["a"]}, {"type": "integer"}]}
    route = validate_constraint(SO(json=schema), "auto")
    assert (route.backend, route.fallback_reason_code, route.partial) == \
        ("guidance", "unenforced_feature", False)
    compiled = StructuredOutputCompiler(tokenizer, vocab_size).compile(SO(json=schema))
    assert compiled.backend == "guidance" and not compiled.partial


def test_feature_detection_reads_schema_positions_only():
    assert xgrammar_unenforced_features({"type": "object", "properties": {
        "not": {"type": "string"}, "contains": {"type": "integer"}}}) == []
    assert xgrammar_unenforced_features({"enum": [{"uniqueItems": True}],
                                         "default": {"not": 1}}) == []
    found = xgrammar_unenforced_features({"$defs": {"x": {"type": "array", "uniqueItems": True}},
                                          "items": {"not": {}}})
    assert sorted(found) == ["`not` (ignored)", "`uniqueItems` (ignored)"]


# ---- best_effort -----------------------------------------------------------------------

def test_best_effort_accepts_partial_enforcement_and_says_so(guidance_rejects, xgrammar_calls):
    route = validate_constraint(SO(json=ALL_OF, best_effort=True), "auto")
    assert route.backend == "xgrammar" and route.partial
    assert route.fallback_reason_code == "best_effort_partial"
    assert "`allOf`" in route.notice and "best_effort" in route.notice
    assert len(xgrammar_calls) == 1


def test_best_effort_compiles_partial(tokenizer, vocab_size, monkeypatch):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    monkeypatch.setattr(compiler.get_backend("guidance"), "compile",
                        lambda params, lenient=False: (_ for _ in ()).throw(
                            ValueError(GUIDANCE_REJECTS)))
    compiled = compiler.compile(SO(json=ALL_OF, best_effort=True))
    assert compiled.backend == "xgrammar" and compiled.partial
    assert compiled.route.fallback_reason_code == "best_effort_partial"


def test_best_effort_o89710_uses_lenient_guidance(tokenizer, vocab_size):
    schema = _o89710()
    params = SO(json=schema, best_effort=True)
    route = validate_constraint(params, "auto")
    assert (route.backend, route.lenient, route.partial) == ("guidance", True, True)
    assert "oneOf" in route.notice and "anyOf" in route.notice
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    compiled = compiler.compile(params)
    assert compiled.backend == "guidance" and compiled.partial
    assert compiled.route == route  # the engine decides what the front end decided
    # What lenient guidance still enforces: both allOf entries, their required properties
    # (xgrammar's outputs lacked `to` and `bodyParts`), the $ref'd objects.
    contact = '[{"email": "a@b.co"}]'
    body = '[{"contentTransferEncoding": "7bit", "contentType": "text/plain", "rawContent": "hi"}]'
    good = f'{{"from": {contact}, "bodyParts": {body}, "to": {contact}}}'
    jsonschema.validate(json.loads(good), schema)
    assert _accepts(compiler, compiled, tokenizer, good)
    assert not _accepts(compiler, compiled, tokenizer, f'{{"from": {contact}, "bodyParts": {body}}}')
    assert not _accepts(compiler, compiled, tokenizer, f'{{"from": {contact}, "to": {contact}}}')
    assert not _accepts(compiler, compiled, tokenizer, '{"type": "text"}')


def _accepts(compiler, compiled, tokenizer, text: str) -> bool:
    matcher = compiler.new_matcher(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_best_effort_is_an_option():
    assert SO(json={"type": "object"}, best_effort=True).key() == \
        ("json", '{"type":"object"}', (("best_effort", True),))
    assert SO(json={"type": "object"}).key() == ("json", '{"type":"object"}')
    with pytest.raises(ValueError, match="best_effort must be a bool"):
        SO(json={"type": "object"}, best_effort="yes").validate()
    # A fully enforced schema is not partial with best_effort either.
    route = validate_constraint(SO(json={"type": "object"}, best_effort=True), "auto")
    assert (route.backend, route.partial, route.fallback_reason_code) == ("xgrammar", False, None)


# ---- the OpenAI front end: 400, notice, metrics -----------------------------------------

class _Engine:
    def __init__(self, metrics):
        self.metrics = metrics


def _count(metrics: EngineMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "folio:structured_outputs_fallbacks_total", {"model_name": "m", "reason": reason})


def test_front_end_400_names_the_keyword(guidance_rejects):
    with pytest.raises(OpenAIError) as info:
        request_constraints.from_structured_outputs({"json": ALL_OF}, "auto")
    assert info.value.param == "structured_outputs" and "`allOf`" in str(info.value)
    with pytest.raises(OpenAIError) as info:
        request_constraints.from_response_format(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": ALL_OF}}, "auto")
    assert info.value.param == "response_format.json_schema.schema"


def test_metrics_count_fallbacks_by_reason(guidance_rejects):
    metrics = EngineMetrics("m", 128)
    assert set(STRUCTURED_OUTPUT_FALLBACK_REASONS) == set(FALLBACK_REASONS)
    assert all(_count(metrics, r) == 0 for r in FALLBACK_REASONS)  # exported from the start
    ctx = request_constraints.constraint_context(_Engine(metrics))
    request = type("R", (), {"response_format": None,
                             "structured_outputs": {"json": ALL_OF, "best_effort": True}})()
    params = request_constraints.request_constraint(request, ctx)
    assert params.best_effort
    assert _count(metrics, "best_effort_partial") == 1
    # The notice for the response, left in the request's context.
    assert ctx.notice and "`allOf`" in ctx.notice
    request_constraints.request_constraint(
        request, request_constraints.constraint_context(_Engine(metrics)))
    assert _count(metrics, "best_effort_partial") == 2
    assert _count(metrics, "unenforced_feature") == 0
    # Fully enforced (with or without best_effort): no notice.
    for value in ({"json": {"type": "object"}}, {"json": {"type": "object"}, "best_effort": True}):
        plain = request_constraints.constraint_context(_Engine(metrics))
        request_constraints.from_structured_outputs(value, plain)
        assert plain.notice is None
    text = metrics.render().decode()
    assert 'folio:structured_outputs_fallbacks_total{model_name="m",reason="best_effort_partial"} 2.0' in text
    with pytest.raises(ValueError):
        metrics.structured_outputs_fallback("something_else")


def test_metrics_count_routing_and_xgrammar_rejections():
    metrics = EngineMetrics("m", 128)
    ctx = request_constraints.constraint_context(_Engine(metrics))
    request_constraints.from_structured_outputs({"json": {"type": "string", "maxLength": 3}}, ctx)
    request_constraints.from_structured_outputs(
        {"json": {"type": "object", "minProperties": 2}}, ctx)
    request_constraints.from_structured_outputs({"json": {"type": "object"}}, ctx)  # no fallback
    assert _count(metrics, "unenforced_feature") == 1
    assert _count(metrics, "xgrammar_rejected") == 1
    assert _count(metrics, "best_effort_partial") == 0


def test_notice_field_is_omitted_unless_set():
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    for cls in (CompletionResponse, ChatCompletionResponse):
        plain = cls(id="x", model="m", choices=[], usage=usage).model_dump()
        assert "structured_outputs_notice" not in plain
        noted = cls(id="x", model="m", choices=[], usage=usage,
                    structured_outputs_notice="best_effort: ...").model_dump()
        assert noted["structured_outputs_notice"] == "best_effort: ..."
