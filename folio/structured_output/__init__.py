"""Structured output (constrained decoding): grammar compile, match, and logit masking.

Names are resolved lazily: `folio.structured_output.params` (imported by SamplingParams, and so
by the torch-free engine core) must not pull in torch or a grammar library through this package.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StructuredOutputsParams": "folio.structured_output.params",
    "allocate_bitmask": "folio.structured_output.backend",
    "bitmask_width": "folio.structured_output.backend",
    "CompiledGrammar": "folio.structured_output.xgrammar_backend",
    "GrammarCompiler": "folio.structured_output.xgrammar_backend",
    "GrammarMatcher": "folio.structured_output.xgrammar_backend",
    "apply_bitmask": "folio.structured_output.xgrammar_backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
