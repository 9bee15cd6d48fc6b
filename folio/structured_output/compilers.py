"""The one structured-output entry point the engine uses: pick a backend, compile, make matchers.

Backends ("xgrammar", "guidance") are created on first use, so a server that only ever sees
xgrammar-compatible constraints never imports llguidance (and vice versa).

The "auto" backend (vLLM's behaviour):
- a Lark grammar goes to guidance (xgrammar only reads EBNF);
- a request with whitespace_pattern goes to guidance (xgrammar has no such option);
- everything else tries xgrammar first and falls back to guidance when xgrammar rejects it,
  unless the request sets disable_fallback. When both reject, the ValueError carries
  xgrammar's message (and guidance's after it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from folio.structured_output.backend import BaseGrammarMatcher
from folio.structured_output.json_features import xgrammar_unenforced_feature
from folio.structured_output.params import StructuredOutputsParams, is_lark_grammar

__all__ = ["BACKENDS", "CompiledConstraint", "StructuredOutputCompiler"]

BACKENDS = ("auto", "xgrammar", "guidance")
_DEFAULT_CACHE_ENTRIES = 256


def choose_backend(params: StructuredOutputsParams, backend: str) -> tuple[str, str | None]:
    """(backend to try first, the reason when `auto` skips xgrammar)."""
    if backend != "auto":
        return backend, None
    if params.kind() == "grammar" and is_lark_grammar(params.grammar or ""):
        return "guidance", "Lark grammar"
    if params.whitespace_pattern is not None:
        return "guidance", "whitespace_pattern"
    if params.kind() == "json":
        unenforced = xgrammar_unenforced_feature(params._json_schema_dict())
        if unenforced is not None:
            return "guidance", f"xgrammar does not enforce {unenforced}"
    return "xgrammar", None


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled constraint and the backend that compiled it."""

    backend: str  # "xgrammar" or "guidance": the one that compiled it (never "auto")
    handle: Any = field(repr=False)  # CompiledGrammar or GuidanceCompiledGrammar
    compile_time_s: float  # wall time of this compile, fallback attempts included
    key: tuple = field(repr=False)  # StructuredOutputsParams.key()
    # Under "auto": why xgrammar was not used (its error, or the routing reason).
    fallback_reason: str | None = None


class StructuredOutputCompiler:
    """One per tokenizer/model. Thread-safe: concurrent compiles of the same constraint
    compile once (the others wait for it); different constraints compile in parallel."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend: str = "auto",
        *,
        stop_token_ids: list[int] | None = None,
        max_threads: int = 1,
        cache_entries: int = _DEFAULT_CACHE_ENTRIES,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown structured output backend {backend!r}; expected one of {list(BACKENDS)}"
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend = backend
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.max_threads = max_threads
        self._backends: dict[str, Any] = {}
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0
        self.fallbacks = 0  # auto: constraints xgrammar rejected that guidance compiled

    # ---- backends, built lazily ----------------------------------------------------------

    def get_backend(self, name: str) -> Any:
        """The backend compiler `name` ("xgrammar" or "guidance"), created on first use."""
        if name not in ("xgrammar", "guidance"):
            raise ValueError(f"unknown structured output backend {name!r}")
        with self._backend_lock:
            compiler = self._backends.get(name)
            if compiler is None:
                if name == "xgrammar":
                    from folio.structured_output.xgrammar_backend import GrammarCompiler as cls
                else:
                    from folio.structured_output.guidance_backend import GuidanceCompiler as cls
                # This cache is the one that counts; the backend keeps a small one of its own.
                compiler = cls(
                    self.tokenizer, self.vocab_size, self.max_threads,
                    stop_token_ids=self.stop_token_ids, cache_entries=16,
                )
                self._backends[name] = compiler
            return compiler

    def loaded_backends(self) -> list[str]:
        with self._backend_lock:
            return sorted(self._backends)

    # ---- compile ---------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """Compile (or fetch from the cache). Raises ValueError with a clear message."""
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(
                f"expected StructuredOutputsParams, got {type(params).__name__}"
            )
        key = params.key()  # validates; raises ValueError naming the field
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
            pending = self._inflight.get(key)
            if pending is None:
                self.cache_misses += 1
                pending = self._inflight[key] = Future()
                owner = True
            else:
                self.cache_hits += 1  # compiled once, by the thread already on it
                owner = False
        if not owner:
            return pending.result()  # re-raises the owner's ValueError
        try:
            compiled = self._compile_uncached(key, params)
        except BaseException as e:
            with self._lock:
                del self._inflight[key]
            pending.set_exception(e)
            raise
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
            del self._inflight[key]
        pending.set_result(compiled)
        return compiled

    def _route(self, params: StructuredOutputsParams) -> tuple[str, str | None]:
        return choose_backend(params, self.backend)

    def _compile_uncached(self, key: tuple, params: StructuredOutputsParams) -> CompiledConstraint:
        start = time.perf_counter()
        first, reason = self._route(params)
        try:
            handle = self.get_backend(first).compile(params)
            return CompiledConstraint(first, handle, time.perf_counter() - start, key, reason)
        except ValueError as e:
            if self.backend == "auto" and first == "guidance" and params.kind() == "json" \
                    and not params.disable_fallback:
                # Sent to guidance for a feature xgrammar would not enforce, but guidance
                # rejects something else: xgrammar still enforces the rest.
                handle = self.get_backend("xgrammar").compile(params)
                return CompiledConstraint("xgrammar", handle, time.perf_counter() - start, key,
                                          f"guidance rejected the schema: {e}")
            if self.backend != "auto" or first != "xgrammar":
                raise
            if params.disable_fallback:
                raise ValueError(f"{e} (xgrammar; no fallback: disable_fallback is set)") from e
            xgrammar_error = e
        try:
            handle = self.get_backend("guidance").compile(params)
        except ValueError as e:
            raise ValueError(
                f"{xgrammar_error} (xgrammar); the guidance fallback also failed: {e}"
            ) from xgrammar_error
        with self._lock:
            self.fallbacks += 1
        return CompiledConstraint(
            "guidance", handle, time.perf_counter() - start, key, str(xgrammar_error)
        )

    # ---- matchers --------------------------------------------------------------------------

    def new_matcher(self, compiled: CompiledConstraint) -> BaseGrammarMatcher:
        """A fresh per-request matcher for a compiled constraint."""
        if not isinstance(compiled, CompiledConstraint):
            raise ValueError(f"expected CompiledConstraint, got {type(compiled).__name__}")
        if compiled.backend == "xgrammar":
            from folio.structured_output.xgrammar_backend import GrammarMatcher

            return GrammarMatcher(compiled.handle)
        if compiled.backend == "guidance":
            from folio.structured_output.guidance_backend import GuidanceMatcher

            return GuidanceMatcher(compiled.handle)
        raise ValueError(f"unknown backend {compiled.backend!r} in CompiledConstraint")

    def cache_size(self) -> int:
        with self._lock:
            return len(self._cache)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
        with self._backend_lock:
            backends = list(self._backends.values())
        for backend in backends:
            backend.clear_cache()
