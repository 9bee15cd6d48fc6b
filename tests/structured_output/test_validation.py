"""Front-end validation of constraints: tokenizer-free, backend-aware, ValueError with the
problem named."""
from __future__ import annotations

import pytest

from folio.structured_output.compilers import choose_backend
from folio.structured_output.params import StructuredOutputsParams as SO
from folio.structured_output.validation import validate_constraint

LARK = 'start: "a" num\nnum: /[0-9]+/\n'


@pytest.mark.parametrize("params, match", [
    (SO(json={"type": "nonsense"}), "json"),
    (SO(regex="(unclosed"), "regex"),
    (SO(grammar="root ::= missing_rule"), "grammar"),
    (SO(structural_tag='{"structures": [{"begin": "<a>", "schema": {"type": "nope"}, '
                       '"end": "</a>"}], "triggers": ["<a>"]}'), "structural_tag"),
])
def test_bad_constraints_raise_naming_the_kind(params, match):
    with pytest.raises(ValueError, match=match):
        validate_constraint(params, "auto")


@pytest.mark.parametrize("params", [
    SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    SO(json_object=True), SO(regex=r"[a-z]{2,5}"), SO(choice=["x", "y"]),
    SO(grammar='root ::= "a" | "b"'),
    SO(structural_tag='{"structures": [{"begin": "<a>", "schema": {"type": "object"}, '
                      '"end": "</a>"}], "triggers": ["<a>"]}'),
])
def test_good_constraints_pass_on_both_backends(params):
    validate_constraint(params, "auto")
    validate_constraint(params, "xgrammar")
    validate_constraint(params, "guidance")


def test_lark_needs_guidance():
    validate_constraint(SO(grammar=LARK), "auto")
    validate_constraint(SO(grammar=LARK), "guidance")
    with pytest.raises(ValueError, match="grammar"):
        validate_constraint(SO(grammar=LARK), "xgrammar")


def test_auto_falls_back_unless_disabled():
    # xgrammar rejects minProperties; guidance takes it.
    schema = {"type": "object", "minProperties": 2}
    validate_constraint(SO(json=schema), "auto")
    with pytest.raises(ValueError, match="json"):
        validate_constraint(SO(json=schema), "xgrammar")
    with pytest.raises(ValueError, match="json"):
        validate_constraint(SO(json=schema, disable_fallback=True), "auto")


def test_unenforced_xgrammar_features_route_to_guidance():
    length_and_pattern = {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3}
    assert choose_backend(SO(json=length_and_pattern), "auto")[0] == "guidance"
    all_of = {"allOf": [{"type": "object"}, {"required": ["a"]}]}
    assert choose_backend(SO(json=all_of), "auto")[0] == "guidance"
    bounded = {"type": "string", "maxLength": 3}
    assert choose_backend(SO(json=bounded), "auto")[0] == "guidance"
    assert choose_backend(SO(json={"type": "string", "enum": ["a"]}), "auto")[0] == "xgrammar"
    assert choose_backend(SO(json=length_and_pattern), "xgrammar")[0] == "xgrammar"
