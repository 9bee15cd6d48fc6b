"""Structured output (constrained decoding): grammar compile, match, and logit masking."""

from folio.structured_output.backend import (
    StructuredOutputsParams,
    allocate_bitmask,
    bitmask_width,
)
from folio.structured_output.xgrammar_backend import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    apply_bitmask,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_width",
]
