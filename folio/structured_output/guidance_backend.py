"""llguidance-backed grammar compilation and matching (vLLM's "guidance" backend).

Same interface and bitmask format as `xgrammar_backend` (bit i of int32 word w allows token
32*w+i), so `masking.apply_token_bitmask` masks logits for either backend.

Each constraint becomes llguidance grammar text in `guidance_grammar` (JSON schemas strict
unless compile(lenient=True), a best_effort request, see compilers.resolve_route; the compiled
grammar's `warnings` then say what was ignored); this module compiles that text against a
tokenizer and matches tokens.

Masks are written with LLMatcher.unsafe_compute_mask_ptr (what llguidance.torch's
fill_next_token_bitmask wraps) after checking dtype/shape/contiguity here: importing
llguidance.torch costs ~3 s, since it applies torch.compile at import time.

Compiling builds (and validates) a template LLMatcher; each request's matcher is a cheap deep
copy of it. Compiled grammars are cached by `StructuredOutputsParams.key()` like xgrammar's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import llguidance.hf
import torch

from folio.structured_output.backend import (
    BaseGrammarCompiler,
    BaseGrammarMatcher,
    GrammarCache,
    StructuredOutputsParams,
    bitmask_width,
)
from folio.structured_output.guidance_grammar import UnsupportedConstraint, grammar_text

__all__ = ["GuidanceCompiledGrammar", "GuidanceCompiler", "GuidanceMatcher"]

_DEFAULT_CACHE_ENTRIES = 256
_MAX_ERROR_CHARS = 2000


def _clean_error(text: str) -> str:
    text = text.strip()
    # Matcher errors append a parser-state dump; the grammar text is the caller's own.
    for marker in ("\n<state>", "<state>\n", "\n<grammar>"):
        cut = text.find(marker)
        if cut > 0:
            text = text[:cut].rstrip()
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + " ..."
    return text or "unknown error"


# ---- compiler ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GuidanceCompiledGrammar:
    """A validated llguidance grammar plus a template matcher (never advanced) to copy."""

    key: tuple  # StructuredOutputsParams.key()
    grammar: str = field(repr=False)  # llguidance grammar text (Lark or JSON form)
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    _template: llg.LLMatcher = field(repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def warnings(self) -> list[str]:
        return list(self._template.get_grammar_warnings())

    def new_ll_matcher(self) -> llg.LLMatcher:
        with self._lock:
            return self._template.deep_copy()


class GuidanceCompiler(BaseGrammarCompiler):
    """One per tokenizer. Thread-safe; compiles outside the cache lock.

    Same constructor as xgrammar_backend.GrammarCompiler. max_threads is accepted for
    interface parity: llguidance compiles each grammar on the calling thread (releasing the
    GIL), so concurrent compile() calls already run in parallel.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_threads: int = 1,
        *,
        any_whitespace: bool = True,
        stop_token_ids: list[int] | None = None,
        cache_entries: int = _DEFAULT_CACHE_ENTRIES,
    ) -> None:
        # vocab_size is the model's logits width, which may exceed len(tokenizer)
        # (padded embeddings); llguidance never allows the padding ids.
        self.vocab_size = vocab_size
        self.max_threads = max_threads
        # Like xgrammar: True allows free whitespace in JSON (vLLM's default); a request's
        # disable_any_whitespace forces compact JSON whatever this default is.
        self.any_whitespace = any_whitespace
        if stop_token_ids:
            stops = [int(t) for t in stop_token_ids]
        else:
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is None:
                raise ValueError(
                    "guidance backend: tokenizer has no eos_token_id; pass stop_token_ids"
                )
            stops = [int(eos)]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(self.stop_token_ids)
            )
        except Exception as e:  # slow (non-"fast") tokenizers, vocab_size too small, ...
            raise ValueError(f"guidance backend cannot use this tokenizer: {e}") from e
        self._cache = GrammarCache(cache_entries)

    def compile(self, params: StructuredOutputsParams, *, lenient: bool = False
                ) -> GuidanceCompiledGrammar:
        """lenient: JSON-schema keywords llguidance does not enforce are ignored (listed in
        the result's `warnings`) instead of rejected."""
        key = params.key()  # validates; raises ValueError naming the field
        cache_key = key + ("lenient",) if lenient else key
        hit = self._cache.get(cache_key)
        if hit is not None:
            return hit
        kind = key[0]
        try:
            grammar = grammar_text(kind, params, self.any_whitespace, lenient)
            template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        except UnsupportedConstraint as e:
            raise ValueError(
                f"unsupported {kind} for structured output (guidance backend): {e}"
            ) from e
        except Exception as e:  # ValueError from the helpers, TypeError/KeyError from bad specs
            detail = _clean_error(str(e)) if str(e) else type(e).__name__
            if isinstance(e, KeyError):
                detail = f"missing field {e}"
            raise ValueError(
                f"invalid {kind} for structured output (guidance backend): {detail}"
            ) from e
        if template.is_error():
            raise ValueError(
                f"invalid {kind} for structured output (guidance backend): "
                f"{_clean_error(template.get_error())}"
            )
        compiled = GuidanceCompiledGrammar(
            key, grammar, self.vocab_size,
            self.stop_token_ids, template,
        )
        return self._cache.put(cache_key, compiled)


# ---- matcher ----------------------------------------------------------------------------

class GuidanceMatcher(BaseGrammarMatcher):
    """Per-request state over a GuidanceCompiledGrammar.

    llguidance's matcher enters a permanent error state when it consumes a forbidden (or
    out-of-range) token, so every token is checked before it is consumed: a rejected token
    leaves the state unchanged, as with xgrammar.
    """

    def __init__(self, compiled: GuidanceCompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = compiled.new_ll_matcher()
        self._stop = frozenset(compiled.stop_token_ids)
        self._width = bitmask_width(compiled.vocab_size)
        self._tokens: list[int] = []  # accepted so far; bounds rollback
        # Per accepted token: did llguidance push it on its own stack? A stop token accepted
        # once the grammar can't extend (is_stopped) is not recorded there, so rolling it
        # back must not roll back llguidance.
        self._recorded: list[bool] = []

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    def _check_ok(self) -> None:
        if self._matcher.is_error():
            error = _clean_error(self._matcher.get_error())
            raise RuntimeError(f"llguidance matcher error: {error}")

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        token = int(token_id)
        if not 0 <= token < self.compiled.vocab_size or self.is_terminated():
            return False
        if not self._allows(token):
            return False
        recorded = token not in self._stop or not self._matcher.is_stopped()
        if not self._matcher.consume_token(token):
            self._check_ok()
            return False
        self._tokens.append(token)
        self._recorded.append(recorded)
        return True

    def _allows(self, token: int) -> bool:
        if token in self._stop:
            # llguidance's validate_tokens() says 0 for EOS once the grammar can't extend
            # (e.g. a finished choice), though EOS is then the one allowed token.
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """Longest allowed prefix of token_ids, without changing state (spec decode)."""
        if self.is_terminated():
            return []
        ids = []
        for tok in token_ids:
            if not 0 <= int(tok) < self.compiled.vocab_size:
                break  # llguidance would enter its error state on it
            ids.append(int(tok))
            if ids[-1] in self._stop:
                break  # nothing is accepted after a stop token
        accepted = self._matcher.validate_tokens(ids) if ids else 0
        if accepted < len(ids) and ids[accepted] in self._stop:
            # See _allows(): check the stop token in the state after the accepted prefix.
            if accepted == 0:
                ok = self._matcher.is_accepting()
            else:
                if not self._matcher.consume_tokens(ids[:accepted]):
                    self._check_ok()
                ok = self._matcher.is_accepting()
                self._matcher.rollback(accepted)
            accepted += int(ok)
        return list(token_ids[:accepted])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected draft tokens)."""
        if num_tokens < 0 or num_tokens > len(self._tokens):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens; {len(self._tokens)} accepted"
            )
        if num_tokens:
            recorded = sum(self._recorded[-num_tokens:])
            if recorded and not self._matcher.rollback(recorded):
                self._check_ok()
                raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens")
            del self._tokens[-num_tokens:]
            del self._recorded[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into bitmask[row]."""
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
            raise ValueError("bitmask must be a 2-D int32 tensor")
        if bitmask.shape[1] < self._width:
            raise ValueError(
                f"bitmask width {bitmask.shape[1]} too small for vocab {self.compiled.vocab_size}"
            )
        if self.is_terminated():
            # After the stop token allow only stop tokens (as the xgrammar matcher does),
            # so a stray extra step can't emit grammar-violating text.
            _fill_only(bitmask, row, self.compiled.stop_token_ids)
            return
        target = bitmask[row]
        if bitmask.device.type == "cpu" and target.is_contiguous():
            # llguidance writes exactly ceil(V/32) words; wider rows get a zero tail.
            self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._width * 4)
            if bitmask.shape[1] > self._width:
                target[self._width:].zero_()
        else:
            tmp = torch.empty(self._width, dtype=torch.int32)
            self._matcher.unsafe_compute_mask_ptr(tmp.data_ptr(), self._width * 4)
            target.zero_()
            target[: self._width].copy_(tmp)
        self._check_ok()

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted (like xgrammar)."""
        return bool(self._tokens) and self._tokens[-1] in self._stop

    def reset(self) -> None:
        self._matcher.reset()
        self._tokens.clear()
        self._recorded.clear()


def _fill_only(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
    for tok in token_ids:
        if 0 <= tok < bitmask.shape[1] * 32:
            words[tok // 32] |= 1 << (tok % 32)
    # Bit 31 is the int32 sign bit: wrap to signed before the cast.
    words = torch.where(words >= (1 << 31), words - (1 << 32), words)
    bitmask[row].copy_(words.to(torch.int32))
