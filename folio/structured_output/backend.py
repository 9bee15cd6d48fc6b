"""Backend-neutral pieces of structured output (constrained decoding).

`StructuredOutputsParams` mirrors vLLM's request-level options; the abstract
classes describe what a grammar backend (xgrammar today) must provide so the
scheduler/sampler wiring can stay backend-agnostic.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from typing import Any

import torch

from folio.structured_output.params import StructuredOutputKind, StructuredOutputsParams

__all__ = [
    "StructuredOutputsParams",
    "StructuredOutputKind",
    "BaseGrammarCompiler",
    "BaseGrammarMatcher",
    "GrammarCache",
    "allocate_bitmask",
    "bitmask_width",
]

class GrammarCache:
    """A thread-safe LRU of compiled grammars by cache key, counting hits and misses; each
    backend's compiler keeps one (compiling happens outside the lock)."""

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return hit

    def put(self, key: tuple, value: Any) -> Any:
        """Store and return the cached value; a concurrent compile of the same key that got
        there first wins, so every caller shares one compiled grammar."""
        with self._lock:
            value = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self._entries:
                self._items.popitem(last=False)
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


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
    """One per tokenizer: turns params into a reusable compiled grammar, kept in `_cache`."""

    _cache: GrammarCache

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any: ...

    @property
    def cache_hits(self) -> int:
        return self._cache.hits

    @property
    def cache_misses(self) -> int:
        return self._cache.misses

    def cache_size(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
