"""Backend-neutral pieces of structured output (constrained decoding).

`StructuredOutputsParams` mirrors vLLM's request-level options; the abstract
classes describe what a grammar backend (xgrammar today) must provide so the
scheduler/sampler wiring can stay backend-agnostic.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from folio.structured_output.params import StructuredOutputKind, StructuredOutputsParams

__all__ = [
    "StructuredOutputsParams",
    "StructuredOutputKind",
    "BaseGrammarCompiler",
    "BaseGrammarMatcher",
    "allocate_bitmask",
    "bitmask_width",
]

def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: one bit per token id."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """[batch, ceil(V/32)] int32, all bits set (= every token allowed)."""
    if batch < 0 or vocab_size <= 0:
        raise ValueError(f"bad bitmask shape: batch={batch}, vocab_size={vocab_size}")
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class BaseGrammarMatcher(abc.ABC):
    """Per-request grammar state: advanced by sampled tokens, queried for masks."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abc.abstractmethod
    def is_terminated(self) -> bool: ...


class BaseGrammarCompiler(abc.ABC):
    """One per tokenizer: turns params into a reusable compiled grammar."""

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any: ...
