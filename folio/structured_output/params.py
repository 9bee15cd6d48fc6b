"""Request-level structured-output options (vLLM's `StructuredOutputsParams`).

Kept free of torch and of any grammar library: SamplingParams carries these into the engine
core, whose scheduler must stay importable without torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["StructuredOutputsParams", "StructuredOutputKind"]

# Field names double as the "kind" in cache keys, so backends can dispatch on them.
StructuredOutputKind = str
_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


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

    def key(self) -> tuple[str, str]:
        """Cache key (kind, canonical text); equal constraints give equal keys."""
        kind = self.kind()
        if kind == "json":
            return (kind, _canonical_json(self._json_schema_dict()))
        if kind == "json_object":
            return (kind, "")
        if kind == "choice":
            return (kind, _canonical_json(list(self.choice or [])))
        if kind == "structural_tag":
            return (kind, _canonical_json(json.loads(self.structural_tag or "")))
        return (kind, getattr(self, kind))
