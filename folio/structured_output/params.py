"""Request-level structured-output options (vLLM's `StructuredOutputsParams`).

Kept free of torch and of any grammar library: SamplingParams carries these into the engine
core, whose scheduler must stay importable without torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "StructuredOutputsParams",
    "StructuredOutputKind",
    "disallow_additional_properties",
    "is_lark_grammar",
]

# Field names double as the "kind" in cache keys, so backends can dispatch on them.
StructuredOutputKind = str
_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


# Request options that change what gets compiled (and so belong in the cache key),
# with their defaults. Order is fixed: it is the order they appear in key().
_OPTION_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("disable_any_whitespace", False),
    ("disable_fallback", False),
    ("disable_additional_properties", False),
    ("whitespace_pattern", None),
    ("best_effort", False),
)

# A Lark rule or terminal definition: `name: ...`, `?name: ...`, `NAME.2: ...`, `name{x}: ...`
# (but not EBNF's `name ::= ...`), or a Lark/llguidance directive.
_LARK_RULE = re.compile(
    r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\{[^}\n]*\})?(\.-?\d+)?[ \t]*:(?!:)", re.M
)
_LARK_DIRECTIVE = re.compile(r"^[ \t]*%(llguidance|ignore|import|declare|override|extend)\b", re.M)
_EBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z0-9_.-]*[ \t]*::=", re.M)


def is_lark_grammar(text: str) -> bool:
    """True for a Lark grammar (llguidance's native syntax: `start: ...`, `name: ...`),
    False for EBNF/GBNF (`root ::= ...`, what xgrammar takes)."""
    if _LARK_DIRECTIVE.search(text):
        return True
    if _EBNF_RULE.search(text):
        return False
    return _LARK_RULE.search(text) is not None


# Keywords whose value is one subschema / a list of subschemas / a map name -> subschema.
_SUBSCHEMA_ONE = (
    "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
    "items", "contains", "propertyNames", "not", "if", "then", "else",
)
_SUBSCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is_object_schema(schema: dict) -> bool:
    t = schema.get("type")
    if t == "object" or (isinstance(t, list) and "object" in t):
        return True
    return t is None and ("properties" in schema or "required" in schema)


def disallow_additional_properties(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema without an explicit
    `additionalProperties` gets `additionalProperties: false` (vLLM's
    disable_additional_properties). Only schema positions are rewritten: a property
    that happens to be named "properties" or "type" is left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if _is_object_schema(out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for name in _SUBSCHEMA_ONE:
        if isinstance(out.get(name), dict):
            out[name] = disallow_additional_properties(out[name])
    for name in _SUBSCHEMA_LIST:
        if isinstance(out.get(name), list):
            out[name] = [disallow_additional_properties(s) for s in out[name]]
    for name in _SUBSCHEMA_MAP:
        if isinstance(out.get(name), dict):
            out[name] = {k: disallow_additional_properties(v) for k, v in out[name].items()}
    return out


def _canonical_json(value: Any) -> str:
    # Sorted keys + compact separators: two requests with the same schema written
    # differently share one compiled grammar.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class StructuredOutputsParams:
    """Exactly one field must be set; it picks the kind of constraint."""

    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF/GBNF (xgrammar's EBNF dialect)
    structural_tag: str | None = None  # JSON text of an xgrammar structural tag spec
    # Options (vLLM's names). They change the compiled grammar, so they are part of key().
    # Compact JSON: no free whitespace between JSON tokens (small models loop on whitespace).
    disable_any_whitespace: bool = False
    # With the "auto" backend: fail instead of falling back to guidance when xgrammar rejects.
    disable_fallback: bool = False
    # JSON schemas: objects without an explicit additionalProperties get additionalProperties:
    # false. (xgrammar, like in vLLM, already rejects undeclared properties; guidance follows
    # JSON Schema and allows them unless this is set.)
    disable_additional_properties: bool = False
    # Regex for the whitespace allowed between JSON tokens; guidance only (xgrammar raises).
    whitespace_pattern: str | None = None
    # Accept a JSON schema that no backend fully enforces (some keyword is then not enforced,
    # and the response says which); without it such a schema is a ValueError naming the
    # keyword. folio's own option (not vLLM's).
    best_effort: bool = False

    def _set_fields(self) -> list[str]:
        # json_object counts as set for any non-False value so a wrong type
        # (e.g. "yes") is reported by name instead of as "none set".
        unset = {name: None for name in _KINDS} | {"json_object": False}
        return [name for name in _KINDS if getattr(self, name) not in (unset[name], None)]

    def kind(self) -> StructuredOutputKind:
        """Name of the single field that is set (validates first)."""
        self.validate()
        return self._set_fields()[0]

    def validate(self) -> None:
        """Raise ValueError naming the offending field(s)."""
        set_fields = self._set_fields()
        if len(set_fields) != 1:
            shown = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(
                "StructuredOutputsParams: exactly one of "
                f"{', '.join(_KINDS)} must be set (got: {shown})"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {type(self.json_object).__name__}")
        for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                     "best_effort"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError(
                    "whitespace_pattern must be a str (a regex) or None, "
                    f"got {type(self.whitespace_pattern).__name__}"
                )
            if not self.whitespace_pattern:
                raise ValueError("whitespace_pattern must be a non-empty regex (or None)")
            if self.disable_any_whitespace:
                raise ValueError(
                    "whitespace_pattern and disable_any_whitespace are mutually exclusive"
                )
        kind = set_fields[0]
        value = getattr(self, kind)
        if kind == "json":
            self._json_schema_dict()  # raises with the field name
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str):
                raise ValueError(f"{kind} must be a str, got {type(value).__name__}")
            if not value:
                raise ValueError(f"{kind} must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError("choice must be a non-empty list of strings")
            bad = [c for c in value if not isinstance(c, str)]
            if bad:
                raise ValueError(f"choice entries must be strings, got {type(bad[0]).__name__}")
        elif kind == "structural_tag":
            if not isinstance(value, str):
                raise ValueError(
                    f"structural_tag must be JSON text (str), got {type(value).__name__}"
                )
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structural_tag is not valid JSON: {e}") from e
            if not isinstance(parsed, dict):
                raise ValueError("structural_tag must be a JSON object")

    def _json_schema_dict(self) -> dict | bool:
        value = self.json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json is not valid JSON text: {e}") from e
        # JSON Schema allows the boolean schemas true/false at the top level.
        if not isinstance(value, (dict, bool)):
            raise ValueError(
                f"json must be a JSON schema object (dict or JSON text), got {type(value).__name__}"
            )
        return value

    def options(self) -> tuple[tuple[str, Any], ...]:
        """The options that differ from their defaults, as (name, value) pairs."""
        return tuple(
            (name, getattr(self, name))
            for name, default in _OPTION_DEFAULTS
            if getattr(self, name) != default
        )

    def key(self) -> tuple:
        """Cache key: (kind, canonical text), plus a tuple of (option, value) pairs when any
        option differs from its default. Equal constraints give equal keys; the same
        constraint with different options gives different keys. Hashable."""
        kind = self.kind()  # validates
        if kind == "json":
            base = (kind, _canonical_json(self._json_schema_dict()))
        elif kind == "json_object":
            base = (kind, "")
        elif kind == "choice":
            base = (kind, _canonical_json(list(self.choice or [])))
        elif kind == "structural_tag":
            base = (kind, _canonical_json(json.loads(self.structural_tag or "")))
        else:
            base = (kind, getattr(self, kind))
        options = self.options()
        return base + (options,) if options else base
