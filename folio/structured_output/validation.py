"""Front-end checks of a constraint, before a request reaches the engine core.

Parsing a schema, regex or grammar needs no tokenizer and takes well under a millisecond; the
expensive part of compiling (the per-token tables) happens once, in the engine core. So a bad
constraint becomes a ValueError (HTTP 400) at once, and the core almost never sees one.
The route is decided as the compiler decides it (`compilers.resolve_route`, with these checks
standing in for the compiles), so a schema no backend fully enforces is refused here, and the
caller gets the ConstraintRoute (fallbacks to count, a best_effort notice to pass on).
"""
from __future__ import annotations

import json
from typing import Any

from folio.structured_output.compilers import ConstraintRoute, resolve_route
from folio.structured_output.params import StructuredOutputsParams

__all__ = ["ConstraintRoute", "validate_constraint"]


def _check_xgrammar(params: StructuredOutputsParams) -> None:
    import xgrammar as xgr

    from folio.structured_output.xgrammar_backend import _clean_error, choice_to_ebnf
    kind = params.kind()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(json.dumps(params._json_schema_dict()))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex or "")
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_to_ebnf(list(params.choice or [])))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar or "")
        elif kind == "structural_tag":
            spec = json.loads(params.structural_tag or "")
            for structure in spec.get("structures", []):
                xgr.Grammar.from_json_schema(json.dumps(structure["schema"]))
        if params.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern needs the guidance backend")
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError; bad specs KeyError/TypeError
        raise ValueError(f"invalid {kind} for structured output: {_clean_error(exc)}") from exc


def _check_guidance(params: StructuredOutputsParams, lenient: bool = False) -> list[str]:
    """Raise ValueError unless guidance accepts the constraint; its warnings (what a lenient
    JSON schema leaves unenforced) otherwise."""
    import llguidance as llg

    from folio.structured_output.guidance_grammar import grammar_text
    kind = params.kind()
    try:
        text = grammar_text(kind, params, lenient=lenient)
    except ValueError as exc:
        raise ValueError(f"invalid {kind} for structured output (guidance backend): {exc}") from exc
    except Exception as exc:
        raise ValueError(f"invalid {kind} for structured output (guidance backend): "
                         f"{type(exc).__name__}: {exc}") from exc
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        error = "; ".join(m.strip() for m in messages) or "unknown error"
        raise ValueError(f"invalid {kind} for structured output (guidance backend): {error}")
    return list(messages)


def _attempt(params: StructuredOutputsParams):
    def attempt(name: str, lenient: bool) -> tuple[Any, list[str]]:
        if name == "guidance":
            return None, _check_guidance(params, lenient)
        _check_xgrammar(params)
        return None, []
    return attempt


def validate_constraint(params: StructuredOutputsParams, backend: str = "auto"
                        ) -> ConstraintRoute:
    """How the engine will enforce the constraint (the same decision as its compiler's).
    Raises ValueError when no backend the engine would use accepts it, or (without
    best_effort) when none enforces every keyword of a JSON schema."""
    params.validate()
    _, route = resolve_route(params, backend, _attempt(params))
    return route
