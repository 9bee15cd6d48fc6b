"""Front-end checks of a constraint, before a request reaches the engine core.

Parsing a schema, regex or grammar needs no tokenizer and takes well under a millisecond; the
expensive part of compiling (the per-token tables) happens once, in the engine core. So a bad
constraint becomes a ValueError (HTTP 400) at once, and the core almost never sees one.
The backend is chosen as the compiler chooses it (`choose_backend`), with the same fallback.
"""
from __future__ import annotations

import json

from folio.structured_output.compilers import choose_backend
from folio.structured_output.params import StructuredOutputsParams


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


def _check_guidance(params: StructuredOutputsParams) -> None:
    import llguidance as llg

    from folio.structured_output.guidance_backend import grammar_text
    kind = params.kind()
    try:
        text = grammar_text(kind, params)
    except ValueError as exc:
        raise ValueError(f"invalid {kind} for structured output (guidance backend): {exc}") from exc
    except Exception as exc:
        raise ValueError(f"invalid {kind} for structured output (guidance backend): "
                         f"{type(exc).__name__}: {exc}") from exc
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"invalid {kind} for structured output (guidance backend): "
                         f"{error.strip()}")


_CHECKS = {"xgrammar": _check_xgrammar, "guidance": _check_guidance}


def validate_constraint(params: StructuredOutputsParams, backend: str = "auto") -> None:
    """Raise ValueError when no backend the engine would use accepts the constraint."""
    params.validate()
    first, _ = choose_backend(params, backend)
    try:
        _CHECKS[first](params)
    except ValueError as first_error:
        if backend != "auto" or params.disable_fallback:
            raise
        other = "guidance" if first == "xgrammar" else "xgrammar"
        try:
            _CHECKS[other](params)
        except ValueError:
            raise first_error from None
