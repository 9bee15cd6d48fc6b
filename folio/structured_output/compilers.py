"""The one structured-output entry point the engine uses: pick a backend, compile, make matchers.

Backends ("xgrammar", "guidance") are created on first use, so a server that only ever sees
xgrammar-compatible constraints never imports llguidance (and vice versa).

The rule: a constraint is never enforced more weakly than asked without saying so.
`resolve_route` decides how a constraint is enforced; the front end's validation
(validation.validate_constraint, in the API process) and this compiler (in the engine core)
both call it, so they agree. With the "auto" backend (vLLM's behaviour, made strict):
- a Lark grammar goes to guidance (xgrammar only reads EBNF);
- a request with whitespace_pattern goes to guidance (xgrammar has no such option);
- a JSON schema with a feature xgrammar compiles without enforcing (json_features.py) goes to
  guidance, which is strict: when guidance rejects it too, no backend enforces every keyword
  and the request is a ValueError naming the keyword (no silent xgrammar fallback);
- everything else tries xgrammar first and falls back to guidance when xgrammar rejects it,
  unless the request sets disable_fallback. When both reject, the ValueError carries
  xgrammar's message (and guidance's after it).
An explicit "xgrammar" backend refuses a schema with such a feature; an explicit "guidance"
backend refuses keywords llguidance does not implement.

Only a request with `best_effort` accepts partial enforcement: guidance in lenient mode
(unimplemented keywords ignored, oneOf enforced as anyOf), else xgrammar; the route is then
`partial`, with a `notice` saying what is not enforced.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from folio.structured_output.backend import BaseGrammarMatcher
from folio.structured_output.json_features import xgrammar_unenforced_features
from folio.structured_output.params import StructuredOutputsParams, is_lark_grammar

__all__ = ["BACKENDS", "FALLBACK_REASONS", "CompiledConstraint", "ConstraintRoute",
           "StructuredOutputCompiler", "choose_backend", "resolve_route"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
_DEFAULT_CACHE_ENTRIES = 256
# Why a constraint is not enforced by the backend "auto" tries first (a metrics label: keep
# the set fixed and small).
FALLBACK_REASONS = ("xgrammar_rejected", "unenforced_feature", "best_effort_partial")
_MAX_NOTICE_CHARS = 500


def choose_backend(params: StructuredOutputsParams, backend: str) -> tuple[str, str | None]:
    """(backend to try first, the reason when `auto` skips xgrammar)."""
    if backend != "auto":
        return backend, None
    if params.kind() == "grammar" and is_lark_grammar(params.grammar or ""):
        return "guidance", "Lark grammar"
    if params.whitespace_pattern is not None:
        return "guidance", "whitespace_pattern"
    if params.kind() == "json":
        unenforced = xgrammar_unenforced_features(params._json_schema_dict())
        if unenforced:
            return "guidance", f"xgrammar does not enforce {unenforced[0]}"
    return "xgrammar", None


@dataclass(frozen=True)
class ConstraintRoute:
    """How a constraint is enforced (what resolve_route decided)."""

    backend: str  # "xgrammar" or "guidance": the one that enforces it
    # One of FALLBACK_REASONS when it is not the plain first choice, else None.
    fallback_reason_code: str | None = None
    detail: str | None = None  # why: xgrammar's error, the routing reason, ...
    partial: bool = False  # True only with best_effort: some keyword is not enforced
    notice: str | None = None  # when partial: what is not enforced
    lenient: bool = False  # guidance compiled in lenient mode


# What llguidance says when it does not implement something (as opposed to a malformed
# schema): only these become "no backend enforces ..." refusals.
_UNSUPPORTED_MARKERS = ("Unimplemented keys", "not supported", "not fully supported",
                        "Unknown format", "only supported")
# Keywords to look for in other messages (not the ones that are also English words).
_KEYWORDS = (
    "oneOf", "anyOf", "allOf", "uniqueItems", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties",
    "patternProperties", "additionalProperties", "format", "pattern", "minLength",
    "maxLength", "multipleOf", "$ref", "prefixItems",
)


def _keywords_in(message: str) -> list[str]:
    """The JSON-schema keywords an llguidance "unsupported" error names."""
    listed = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if listed:
        return re.findall(r'"([^"]+)"', listed.group(1))
    if "min/maxProperties" in message:
        return ["minProperties", "maxProperties"]
    if "Unknown format" in message:
        return ["format"]
    if "lookaround" in message or "backreference" in message:
        return ["pattern"]
    found = [(m.start(), k) for k in _KEYWORDS
             for m in [re.search(rf"(?<![\w$]){re.escape(k)}(?!\w)", message)] if m]
    return [k for _, k in sorted(found)][:1]


def _backticked(features: list[str]) -> list[str]:
    return list(dict.fromkeys(re.findall(r"`([^`]+)`", " ".join(features))))


def _short(text: str, limit: int = _MAX_NOTICE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _is_unsupported(error: Exception) -> bool:
    return any(marker in str(error) for marker in _UNSUPPORTED_MARKERS)


def _refusal(guidance_error: ValueError, unenforced: list[str], subject: str) -> ValueError:
    """subject: "no backend enforces" or "the guidance backend does not enforce"."""
    keywords = _keywords_in(str(guidance_error)) if _is_unsupported(guidance_error) else []
    named = ", ".join(f"`{k}`" for k in keywords or _backticked(unenforced))
    message = f"{subject} every keyword of this JSON schema" + (f" ({named})" if named else "")
    message += f": guidance rejects it: {guidance_error}"
    if unenforced:
        message += f"; xgrammar does not enforce {', '.join(unenforced)}"
    return ValueError(message + ". Change the schema, or set best_effort to accept a "
                      "partially enforced schema (the response then says what is not enforced)")


# attempt(backend, lenient) -> (result, warnings); raises ValueError when it can't.
Attempt = Callable[[str, bool], tuple[Any, list[str]]]


def resolve_route(params: StructuredOutputsParams, backend: str, attempt: Attempt
                  ) -> tuple[Any, ConstraintRoute]:
    """Decide how `params` is enforced under `backend`, calling `attempt` for each try
    (a tokenizer-free check in the front end, a real compile in the engine). Returns the
    successful attempt's result and the route; raises ValueError naming the problem."""
    first, reason = choose_backend(params, backend)
    kind = params.kind()
    unenforced = (xgrammar_unenforced_features(params._json_schema_dict())
                  if kind == "json" else [])
    best_effort = params.best_effort

    if first == "xgrammar":
        if unenforced:  # only with the explicit xgrammar backend: "auto" sent it to guidance
            if not best_effort:
                raise ValueError(
                    f"the xgrammar backend does not enforce {', '.join(unenforced)} of this "
                    "JSON schema. Use the auto or guidance backend, change the schema, or set "
                    "best_effort to accept a partially enforced schema")
            result, _ = attempt("xgrammar", False)
            return result, ConstraintRoute(
                "xgrammar", "best_effort_partial", f"xgrammar does not enforce {unenforced[0]}",
                partial=True, notice=_short(
                    f"best_effort: xgrammar does not enforce {', '.join(unenforced)}"))
        try:
            result, _ = attempt("xgrammar", False)
            return result, ConstraintRoute("xgrammar")
        except ValueError as e:
            if backend != "auto":
                raise
            if params.disable_fallback:
                raise ValueError(f"{e} (xgrammar; no fallback: disable_fallback is set)") from e
            xgrammar_error = e
        try:
            result, _ = attempt("guidance", False)
            return result, ConstraintRoute("guidance", "xgrammar_rejected", str(xgrammar_error))
        except ValueError as e:
            guidance_error = e
        if best_effort and kind == "json" and _is_unsupported(guidance_error):
            try:
                result, warnings = attempt("guidance", True)
            except ValueError:
                pass
            else:
                return result, _lenient_route(str(xgrammar_error), warnings, guidance_error)
        raise ValueError(
            f"{xgrammar_error} (xgrammar); the guidance fallback also failed: {guidance_error}"
        ) from xgrammar_error

    # guidance first: explicitly, or "auto" routed it there.
    # (choose_backend sends a JSON schema to guidance for whitespace_pattern before features)
    routed_for_feature = backend == "auto" and bool(unenforced) \
        and params.whitespace_pattern is None
    try:
        result, _ = attempt("guidance", False)
        return result, ConstraintRoute(
            "guidance", "unenforced_feature" if routed_for_feature else None, reason)
    except ValueError as e:
        guidance_error = e
    # llguidance does not implement something (rather than: the constraint is malformed).
    unsupported = kind == "json" and _is_unsupported(guidance_error)
    if not (best_effort and kind == "json"):
        if routed_for_feature:  # and xgrammar would not enforce that feature
            raise _refusal(guidance_error, unenforced, "no backend enforces") from guidance_error
        if unsupported:
            raise _refusal(guidance_error, [], "the guidance backend does not enforce"
                           ) from guidance_error
        raise guidance_error  # a malformed constraint
    if unsupported:
        try:
            result, warnings = attempt("guidance", True)
        except ValueError:
            pass
        else:
            return result, _lenient_route(reason, warnings, guidance_error)
    if routed_for_feature:
        try:
            result, _ = attempt("xgrammar", False)
        except ValueError:
            raise guidance_error from None
        return result, ConstraintRoute(
            "xgrammar", "best_effort_partial", f"guidance rejected the schema: {guidance_error}",
            partial=True, notice=_short(
                f"best_effort: xgrammar does not enforce {', '.join(unenforced)} "
                f"(guidance rejected the schema: {guidance_error})"))
    raise guidance_error


def _lenient_route(detail: str | None, warnings: list[str], strict_error: ValueError
                   ) -> ConstraintRoute:
    ignored = "; ".join(w.strip() for w in warnings if w.strip()) or str(strict_error)
    return ConstraintRoute(
        "guidance", "best_effort_partial", detail, partial=True, lenient=True,
        notice=_short(f"best_effort: guidance does not enforce everything: {ignored}"))


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled constraint and the backend that compiled it."""

    backend: str  # "xgrammar" or "guidance": the one that compiled it (never "auto")
    handle: Any = field(repr=False)  # CompiledGrammar or GuidanceCompiledGrammar
    key: tuple = field(repr=False)  # StructuredOutputsParams.key()
    # Under "auto": why xgrammar was not used (its error, or the routing reason).
    fallback_reason: str | None = None
    route: ConstraintRoute | None = field(default=None, repr=False, compare=False)

    @property
    def partial(self) -> bool:
        """True when some keyword is not enforced (best_effort requests only)."""
        return self.route is not None and self.route.partial


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

    def _attempt(self, params: StructuredOutputsParams) -> Attempt:
        def attempt(name: str, lenient: bool) -> tuple[Any, list[str]]:
            if name == "guidance" and lenient:
                handle = self.get_backend("guidance").compile(params, lenient=True)
                return handle, handle.warnings
            return self.get_backend(name).compile(params), []
        return attempt

    def _compile_uncached(self, key: tuple, params: StructuredOutputsParams) -> CompiledConstraint:
        handle, route = resolve_route(params, self.backend, self._attempt(params))
        if route.fallback_reason_code == "xgrammar_rejected":
            with self._lock:
                self.fallbacks += 1
        if route.partial:
            logger.warning("structured output %s: partially enforced on %s (best_effort): %s",
                           params.kind(), route.backend, route.notice)
        elif route.fallback_reason_code is not None:
            logger.info("structured output %s: %s on %s: %s", params.kind(),
                        route.fallback_reason_code, route.backend, _short(route.detail or ""))
        return CompiledConstraint(route.backend, handle, key, route.detail, route)

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
