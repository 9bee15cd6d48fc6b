"""xgrammar-backed grammar compilation, matching and logit masking.

Compilation is the expensive step (tens of ms to seconds for big JSON schemas),
so `GrammarCompiler` caches compiled grammars by `StructuredOutputsParams.key()`;
matchers are cheap and made per request.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr

from folio.structured_output.backend import (
    BaseGrammarCompiler,
    BaseGrammarMatcher,
    GrammarCache,
    StructuredOutputsParams,
    bitmask_width,
)
from folio.structured_output.masking import apply_token_bitmask
from folio.structured_output.params import disallow_additional_properties, is_lark_grammar

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "apply_bitmask"]

# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: " and
# sometimes "Check failed: (...) is false: "; users only need the rest.
_LOG_PREFIX = re.compile(r"^\s*\[\d{2}:\d{2}:\d{2}\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_DEFAULT_CACHE_ENTRIES = 256


def _clean_error(exc: BaseException) -> str:
    text = str(exc).strip()
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text)
    return text.strip() or type(exc).__name__


def choice_to_ebnf(choices: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are valid xgrammar EBNF literals,
    # so json.dumps gives a correctly escaped alternative for any choice text.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint plus what was compiled (for logs and debugging)."""

    key: tuple  # StructuredOutputsParams.key()
    handle: xgr.CompiledGrammar = field(repr=False)
    vocab_size: int

    @property
    def memory_size_bytes(self) -> int:
        return int(self.handle.memory_size_bytes)


class GrammarCompiler(BaseGrammarCompiler):
    """One per tokenizer. Thread-safe; compiles outside the cache lock."""

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
        # (padded embeddings); xgrammar masks the padding ids out.
        self.vocab_size = vocab_size
        # any_whitespace=True matches vLLM's default; False forces compact JSON,
        # which stops small models from looping on whitespace. A request's
        # disable_any_whitespace=True forces compact JSON whatever this default is.
        self.any_whitespace = any_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._cache = GrammarCache(cache_entries)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.key()  # validates; raises ValueError naming the field
        if params.whitespace_pattern is not None:
            raise ValueError(
                "whitespace_pattern is not supported by the xgrammar backend "
                "(use the guidance or auto backend)"
            )
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            handle = self._compile_uncached(params.kind(), params)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/pydantic/TypeError
            hint = ""
            if key[0] == "grammar" and is_lark_grammar(params.grammar or ""):
                hint = " (this looks like a Lark grammar: use the guidance or auto backend)"
            raise ValueError(
                f"invalid {key[0]} for structured output: {_clean_error(e)}{hint}"
            ) from e
        compiled = CompiledGrammar(key, handle, self.vocab_size)
        return self._cache.put(key, compiled)

    def _compile_uncached(self, kind: str, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler
        any_whitespace = self.any_whitespace and not params.disable_any_whitespace
        if kind == "json":
            schema = params._json_schema_dict()
            if params.disable_additional_properties:
                # xgrammar's strict mode (on, as in vLLM) already treats a missing
                # additionalProperties as false; made explicit so both backends agree.
                schema = disallow_additional_properties(schema)
            return c.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
        if kind == "json_object":
            # Like vLLM: "any JSON object" rather than xgrammar's any-JSON-value builtin.
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return c.compile_regex(params.regex or "")
        if kind == "choice":
            return c.compile_grammar(choice_to_ebnf(list(params.choice or [])))
        if kind == "grammar":
            return c.compile_grammar(params.grammar or "")
        if kind == "structural_tag":
            return self._compile_structural_tag(json.loads(params.structural_tag or ""))
        raise ValueError(f"unsupported structured output kind: {kind}")

    def _compile_structural_tag(self, spec: dict) -> xgr.CompiledGrammar:
        if "structures" in spec:
            # Legacy vLLM/OpenAI-style {"structures": [{begin, schema, end}], "triggers": [...]}.
            tags = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in spec["structures"]
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return self._compiler.compile_structural_tag(tags, list(spec.get("triggers", [])))
        return self._compiler.compile_structural_tag(json.dumps(spec))

    def clear_cache(self) -> None:
        super().clear_cache()
        self._compiler.clear_cache()


class GrammarMatcher(BaseGrammarMatcher):
    """Per-request state over a CompiledGrammar."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled.handle)
        # Tokens accepted so far; bounds rollback (xgrammar itself allows unlimited).
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it. Nothing
        follows the stop token: a terminated matcher refuses here, as guidance's does,
        rather than in xgrammar (which logs a warning each time: a draft after a drafted
        stop token did, once per verify step)."""
        if self._matcher.is_terminated():
            return False
        if self._matcher.accept_token(int(token_id)):
            self.num_accepted += 1
            return True
        return False

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """Longest allowed prefix of token_ids, without changing state (spec decode)."""
        accepted = 0
        for tok in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(tok)):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return list(token_ids[:accepted])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected draft tokens)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens; {self.num_accepted} accepted"
            )
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into bitmask[row]."""
        if self._matcher.is_terminated():
            # xgrammar refuses to fill after the stop token; allow only stop
            # tokens so a stray extra step can't emit grammar-violating text.
            bitmask[row].zero_()
            for tok in self._matcher.stop_token_ids:
                if tok < bitmask.shape[1] * 32:
                    word, bit = divmod(tok, 32)
                    value = int(bitmask[row, word]) | (1 << bit)
                    # Store as signed int32 (bit 31 is the sign bit).
                    bitmask[row, word] = value - (1 << 32) if value >= (1 << 31) else value
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()
        self.num_accepted = 0


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> None:
    """In place: logits of disallowed tokens -> -inf. rows limits which rows are masked
    (requests without constraints in a mixed batch are skipped). A checked front to
    `masking.apply_token_bitmask`, the one implementation the engine uses for every backend."""
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits and bitmask must be 2-D [batch, ...]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] < bitmask_width(logits.shape[1]):
        raise ValueError(
            f"bitmask width {bitmask.shape[1]} too small for vocab {logits.shape[1]}"
        )
    batch = logits.shape[0]
    if rows is None:
        rows = list(range(batch))
    if not rows:
        return
    bitmask = bitmask[:batch]
    listed = set(rows)
    if len(listed) < batch:
        # apply_token_bitmask may mask every row at once: unlisted rows must allow everything.
        bitmask = bitmask.clone()
        bitmask[[i for i in range(batch) if i not in listed]] = -1
    apply_token_bitmask(logits, bitmask, rows)
