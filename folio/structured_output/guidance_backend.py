"""llguidance-backed grammar compilation and matching (vLLM's "guidance" backend).

Same interface and bitmask format as `xgrammar_backend` (bit i of int32 word w allows token
32*w+i), so `masking.apply_token_bitmask` masks logits for either backend.

llguidance speaks Lark natively (with `%json {...}` for inline JSON schemas); everything else
is turned into an llguidance grammar here:

- json / json_object: llguidance's JSON-schema compiler; disable_any_whitespace and
  whitespace_pattern become its `whitespace_flexible` / `whitespace_pattern` options.
  Without free whitespace the separators are ", " and ": " (xgrammar's compact form).
  Always strict (`lenient: false`, `coerce_one_of: false`, whatever the schema's own
  "x-guidance" says): a keyword llguidance does not implement, or a oneOf it cannot prove
  exclusive, is an error naming it, never silently dropped. Only compile(lenient=True) (a
  best_effort request, see compilers.resolve_route) lets llguidance ignore them; the
  compiled grammar's `warnings` then say what was ignored.
- regex: llguidance's regex (Rust `regex` crate syntax: `\\p{L}`, `(?i)` work; no lookaround,
  no backreferences), with `\\d`/`\\w` made ASCII as in xgrammar.
- choice: a Lark alternation of string literals.
- grammar: Lark is used as is; EBNF/GBNF (xgrammar's dialect) is converted to Lark with
  llguidance's GBNF converter, which does not know xgrammar's extensions (e.g. lookahead
  `(= ...)`); those fail with a ValueError that says so.
- structural_tag: translated to Lark. The legacy {"structures", "triggers"} form and the
  {"type": "structural_tag", "format": ...} form are supported for the format types
  const_string, json_schema (default style), regex, grammar, any_text (no excludes/limits),
  sequence, or, optional, star, plus, repeat, tag (string begin/end), triggered_tags (no
  excludes) and tags_with_separator; token-level formats raise a ValueError naming the type.

Masks are written with LLMatcher.unsafe_compute_mask_ptr (what llguidance.torch's
fill_next_token_bitmask wraps) after checking dtype/shape/contiguity here: importing
llguidance.torch costs ~3 s, since it applies torch.compile at import time.

Compiling builds (and validates) a template LLMatcher; each request's matcher is a cheap deep
copy of it. Compiled grammars are cached by `StructuredOutputsParams.key()` like xgrammar's.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from folio.structured_output.backend import (
    BaseGrammarCompiler,
    BaseGrammarMatcher,
    GrammarCache,
    StructuredOutputsParams,
    bitmask_width,
)
from folio.structured_output.params import disallow_additional_properties, is_lark_grammar

__all__ = ["GuidanceCompiledGrammar", "GuidanceCompiler", "GuidanceMatcher"]

_DEFAULT_CACHE_ENTRIES = 256
_MAX_ERROR_CHARS = 2000
_ANY_TEXT = r"/(.|\n)*/"


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


class _Unsupported(ValueError):
    """A constraint the guidance backend can't express (not a malformed one)."""


# ---- structural tags -> Lark ------------------------------------------------------------

class _StructuralTagToLark:
    """Translate an xgrammar structural-tag spec (either form) into an llguidance grammar."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.sub_grammars: list[dict[str, str]] = []
        self._n = 0

    def _fresh(self, stem: str) -> str:
        self._n += 1
        return f"st_{stem}_{self._n}"

    @staticmethod
    def _lit(text: str) -> str:
        if not isinstance(text, str):
            raise ValueError(f"expected a string, got {type(text).__name__}")
        # JSON string escapes are valid Lark/llguidance string literals.
        return json.dumps(text, ensure_ascii=False) if text else '""'

    def translate(self, spec: dict) -> str:
        if "structures" in spec:
            fmt = self._legacy_to_format(spec)
        elif spec.get("type") == "structural_tag" and isinstance(spec.get("format"), dict):
            fmt = spec["format"]
        else:
            raise ValueError(
                'expected {"type": "structural_tag", "format": {...}} or '
                '{"structures": [...], "triggers": [...]}'
            )
        top = self.expr(fmt)
        lark = "%llguidance {}\n" + f"start: {top}\n" + "".join(r + "\n" for r in self.rules)
        if not self.sub_grammars:
            return lark
        return json.dumps(
            {"grammars": [{"name": "structural_tag", "lark_grammar": lark}, *self.sub_grammars]}
        )

    @staticmethod
    def _legacy_to_format(spec: dict) -> dict:
        # Legacy vLLM/OpenAI form: free text with tool calls {begin, schema, end} that start
        # when one of the triggers appears -- xgrammar's triggered_tags.
        structures = spec.get("structures")
        triggers = spec.get("triggers", [])
        if not isinstance(structures, list) or not structures:
            raise ValueError('"structures" must be a non-empty list')
        tags = []
        for s in structures:
            if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
                raise ValueError('each structure needs "begin", "schema" and "end"')
            tags.append({
                "type": "tag", "begin": s["begin"], "end": s["end"],
                "content": {"type": "json_schema", "json_schema": s["schema"]},
            })
        return {"type": "triggered_tags", "triggers": triggers, "tags": tags}

    def expr(self, fmt: Any) -> str:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError(f"a format must be an object with a string \"type\", got {fmt!r:.80}")
        kind = fmt["type"]
        method = getattr(self, f"_fmt_{kind}", None)
        if method is None:
            raise _Unsupported(f"format type {kind!r} is not supported by the guidance backend")
        return method(fmt)

    def _fmt_const_string(self, fmt: dict) -> str:
        return self._lit(fmt["value"])

    def _fmt_json_schema(self, fmt: dict) -> str:
        if fmt.get("style", "json") != "json" or fmt.get("any_order") or fmt.get("excludes"):
            raise _Unsupported(
                "json_schema formats with a non-default style/any_order/excludes are not "
                "supported by the guidance backend"
            )
        schema = fmt["json_schema"]
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON schema object")
        return "%json " + json.dumps(schema, ensure_ascii=False)

    def _fmt_regex(self, fmt: dict) -> str:
        if fmt.get("excludes"):
            raise _Unsupported(
                "regex formats with excludes are not supported by the guidance backend"
            )
        return _regex_to_lark(fmt["pattern"])

    def _fmt_grammar(self, fmt: dict) -> str:
        text = fmt["grammar"]
        if fmt.get("syntax", "ebnf") != "lark" and not is_lark_grammar(text):
            text = _ebnf_to_lark(text)
        name = self._fresh("grammar")
        self.sub_grammars.append({"name": name, "lark_grammar": text})
        return "@" + name

    def _fmt_any_text(self, fmt: dict) -> str:
        limits = [fmt.get("max_tokens"), fmt.get("max_chars")]
        if fmt.get("excludes") or any(limit is not None for limit in limits):
            raise _Unsupported(
                "any_text with excludes/max_tokens/max_chars is not supported "
                "by the guidance backend"
            )
        return _ANY_TEXT

    def _elements(self, fmt: dict) -> list[str]:
        elements = fmt.get("elements")
        if not isinstance(elements, list) or not elements:
            raise ValueError(f"{fmt['type']} needs a non-empty \"elements\" list")
        return [self.expr(e) for e in elements]

    def _fmt_sequence(self, fmt: dict) -> str:
        return "(" + " ".join(self._elements(fmt)) + ")"

    def _fmt_or(self, fmt: dict) -> str:
        return "(" + " | ".join(self._elements(fmt)) + ")"

    def _fmt_optional(self, fmt: dict) -> str:
        return f"({self.expr(fmt['content'])})?"

    def _fmt_star(self, fmt: dict) -> str:
        return f"({self.expr(fmt['content'])})*"

    def _fmt_plus(self, fmt: dict) -> str:
        return f"({self.expr(fmt['content'])})+"

    def _fmt_repeat(self, fmt: dict) -> str:
        lo, hi = fmt["min"], fmt["max"]
        if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or (0 <= hi < lo):
            raise ValueError(f"bad repeat bounds min={lo!r} max={hi!r}")
        body = self.expr(fmt["content"])
        return f"({body}){{{lo},}}" if hi < 0 else f"({body}){{{lo},{hi}}}"

    def _tag_parts(self, tag: dict, skip_prefix: str = "") -> str:
        """`begin content end` (begin minus skip_prefix, already matched by a trigger)."""
        if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
            raise ValueError("tags must be tag formats")
        begin, end = tag.get("begin"), tag.get("end")
        if not isinstance(begin, str):
            raise _Unsupported("token begin/end tags are not supported by the guidance backend")
        ends = end if isinstance(end, list) else [end]
        if not ends or not all(isinstance(e, str) for e in ends):
            raise _Unsupported("token begin/end tags are not supported by the guidance backend")
        end_expr = "(" + " | ".join(self._lit(e) for e in ends) + ")"
        rest = begin[len(skip_prefix):]
        head = self._lit(rest) if rest else ""
        content = tag.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text" and any(ends):
            # xgrammar's any_text inside a tag stops at the first end string: a lazy lexeme.
            self._fmt_any_text(content)
            name = self._fresh("text")
            self.rules.append(f"{name}[lazy]: {_ANY_TEXT} {end_expr}")
            return f"{head} {name}".strip()
        return f"{head} {self.expr(content)} {end_expr}".strip()

    def _fmt_tag(self, fmt: dict) -> str:
        return "(" + self._tag_parts(fmt) + ")"

    def _tags(self, fmt: dict) -> list[dict]:
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{fmt['type']} needs a non-empty \"tags\" list")
        return tags

    def _fmt_triggered_tags(self, fmt: dict) -> str:
        if fmt.get("excludes"):
            raise _Unsupported(
                "triggered_tags with excludes is not supported by the guidance backend"
            )
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers
        ):
            raise ValueError("triggers must be a non-empty list of non-empty strings")
        alternatives = []
        for tag in self._tags(fmt):
            begin = tag.get("begin") if isinstance(tag, dict) else None
            if not isinstance(begin, str):
                raise _Unsupported("token begin tags are not supported by the guidance backend")
            matching = [t for t in triggers if begin.startswith(t)]
            if not matching:
                raise ValueError(f"tag begin {begin!r} does not start with any trigger {triggers}")
            trigger = max(matching, key=len)
            # Free text up to (and including) the first occurrence of the trigger.
            trig_rule = self._fresh("trigger")
            self.rules.append(f"{trig_rule}[lazy]: {_ANY_TEXT} {self._lit(trigger)}")
            alternatives.append(f"{trig_rule} {self._tag_parts(tag, skip_prefix=trigger)}")
        segment = self._fresh("segment")
        self.rules.append(f"{segment}: " + " | ".join(alternatives))
        at_least_one = bool(fmt.get("at_least_one"))
        if fmt.get("stop_after_first"):
            return f"({segment})" if at_least_one else f"({segment} | {_ANY_TEXT})"
        return f"({segment}{'+' if at_least_one else '*'} {_ANY_TEXT})"

    def _fmt_tags_with_separator(self, fmt: dict) -> str:
        tag_rule = self._fresh("tag")
        self.rules.append(
            f"{tag_rule}: " + " | ".join(f"({self._tag_parts(t)})" for t in self._tags(fmt))
        )
        at_least_one = bool(fmt.get("at_least_one"))
        if fmt.get("stop_after_first"):
            return tag_rule if at_least_one else f"({tag_rule})?"
        sep = self._lit(fmt.get("separator", ""))
        body = f"{tag_rule} ({sep} {tag_rule})*"
        return f"({body})" if at_least_one else f"({body})?"


def _regex_to_lark(pattern: str) -> str:
    # A Lark regex terminal: "/" escaped; \d and \w made ASCII like xgrammar's (Rust's are
    # Unicode: \d{3} could give "߆18").
    return "/" + llg.regex_to_lark(pattern, "dw") + "/"


def _ebnf_to_lark(text: str) -> str:
    try:
        return gbnf_to_lark(text)
    except Exception as e:
        raise ValueError(
            "could not convert the EBNF/GBNF grammar to Lark for the guidance backend "
            f"({e}); xgrammar-only EBNF extensions such as lookahead '(= ...)' are not "
            "supported there: write the grammar in Lark or use the xgrammar backend"
        ) from e


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


# No free whitespace; fixed separators as xgrammar's any_whitespace=False writes them
# ({"a": 1, "b": [1, 2]}), so both backends give the same JSON.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

def _json_grammar(schema: Any, params: StructuredOutputsParams, any_whitespace: bool,
                  lenient: bool = False) -> str:
    # llguidance applies defaults, then the schema's own "x-guidance" options, then
    # overrides: the compiler's default yields to the schema, the request's options don't.
    defaults = {"whitespace_flexible": True} if any_whitespace else dict(_COMPACT)
    # Strict unless asked: unimplemented keywords and a not-provably-exclusive oneOf are
    # errors. (lenient implies coerce_one_of, so it must not be forced off then.)
    overrides: dict[str, Any] = {"lenient": True} if lenient else {
        "lenient": False, "coerce_one_of": False}
    if params.whitespace_pattern is not None:
        overrides |= {
            "whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern,
        }
    elif params.disable_any_whitespace:
        overrides |= _COMPACT
    return llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults=defaults, overrides=overrides
    )

def grammar_text(kind: str, params: StructuredOutputsParams, any_whitespace: bool = True,
                 lenient: bool = False) -> str:
    """The llguidance grammar for a constraint (no tokenizer needed: also used to validate).
    lenient: let llguidance ignore the JSON-schema keywords it does not enforce."""
    if kind == "json":
        schema = params._json_schema_dict()
        if params.disable_additional_properties:
            schema = disallow_additional_properties(schema)
        if schema is True:
            schema = {}
        elif schema is False:
            raise ValueError("the schema `false` matches nothing")
        return _json_grammar(schema, params, any_whitespace, lenient)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, params, any_whitespace)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_lark(f"start: {_regex_to_lark(params.regex or '')}\n")
    if kind == "choice":
        alternatives = " | ".join(
            json.dumps(c, ensure_ascii=False) for c in (params.choice or [])
        )
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind == "grammar":
        text = params.grammar or ""
        if not is_lark_grammar(text):
            text = _ebnf_to_lark(text)
        return llg.LLMatcher.grammar_from_lark(text)
    if kind == "structural_tag":
        spec = json.loads(params.structural_tag or "")
        return _StructuralTagToLark().translate(spec)
    raise ValueError(f"unsupported structured output kind: {kind}")


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
        except _Unsupported as e:
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
