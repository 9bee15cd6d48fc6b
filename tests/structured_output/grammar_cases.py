"""Constraints both backends' tests run: one schema, regex, choice list and EBNF grammar."""
from __future__ import annotations

from pathlib import Path

BENCH = Path("/work/shared/testdata/jsonschemabench_sample.jsonl")
MAX_STEPS = 200

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-[a-z]{2,4}(\.[A-Z])?"
CHOICES = ["red", "green", "blue", 'say "hi"\n']
# Parenthesised sums of digits: "(1+2+3)".
EBNF = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
EBNF_RE = r"\(\d(\+\d)*\)"
