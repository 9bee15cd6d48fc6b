"""Structured output (constrained decoding): grammar compile, match, and logit masking.

Names are resolved lazily: `folio.structured_output.params` (imported by SamplingParams, and so
by the torch-free engine core) must not pull in torch or a grammar library through this package.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StructuredOutputsParams": "folio.structured_output.params",
    "disallow_additional_properties": "folio.structured_output.params",
    "is_lark_grammar": "folio.structured_output.params",
    "allocate_bitmask": "folio.structured_output.backend",
    "bitmask_width": "folio.structured_output.backend",
    "CompiledGrammar": "folio.structured_output.xgrammar_backend",
    "GrammarCompiler": "folio.structured_output.xgrammar_backend",
    "GrammarMatcher": "folio.structured_output.xgrammar_backend",
    "apply_bitmask": "folio.structured_output.xgrammar_backend",
    "GuidanceCompiledGrammar": "folio.structured_output.guidance_backend",
    "GuidanceCompiler": "folio.structured_output.guidance_backend",
    "GuidanceMatcher": "folio.structured_output.guidance_backend",
    "BACKENDS": "folio.structured_output.compilers",
    "CompiledConstraint": "folio.structured_output.compilers",
    "ConstraintRoute": "folio.structured_output.compilers",
    "StructuredOutputCompiler": "folio.structured_output.compilers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
