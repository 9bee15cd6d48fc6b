"""Constraints -> llguidance grammar text (`grammar_text`): the guidance backend's translator.
No tokenizer and no torch, so the front end's validation uses it too.

llguidance speaks Lark natively (with `%json {...}` for inline JSON schemas); everything else
is turned into an llguidance grammar here:

- json / json_object: llguidance's JSON-schema compiler; disable_any_whitespace and
  whitespace_pattern become its `whitespace_flexible` / `whitespace_pattern` options.
  Without free whitespace the separators are ", " and ": " (xgrammar's compact form).
  Always strict (`lenient: false`, `coerce_one_of: false`, whatever the schema's own
  "x-guidance" says): a keyword llguidance does not implement, or a oneOf it cannot prove
  exclusive, is an error naming it, never silently dropped. Only lenient=True (a
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
  excludes) and tags_with_separator; token-level formats raise UnsupportedConstraint (a
  ValueError) naming the type.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark

from folio.structured_output.params import (
    StructuredOutputsParams,
    disallow_additional_properties,
    is_lark_grammar,
)

__all__ = ["UnsupportedConstraint", "grammar_text"]

_ANY_TEXT = r"/(.|\n)*/"


class UnsupportedConstraint(ValueError):
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
            raise UnsupportedConstraint(
                f"format type {kind!r} is not supported by the guidance backend"
            )
        return method(fmt)

    def _fmt_const_string(self, fmt: dict) -> str:
        return self._lit(fmt["value"])

    def _fmt_json_schema(self, fmt: dict) -> str:
        if fmt.get("style", "json") != "json" or fmt.get("any_order") or fmt.get("excludes"):
            raise UnsupportedConstraint(
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
            raise UnsupportedConstraint(
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
            raise UnsupportedConstraint(
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
            raise UnsupportedConstraint(
                "token begin/end tags are not supported by the guidance backend"
            )
        ends = end if isinstance(end, list) else [end]
        if not ends or not all(isinstance(e, str) for e in ends):
            raise UnsupportedConstraint(
                "token begin/end tags are not supported by the guidance backend"
            )
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
            raise UnsupportedConstraint(
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
                raise UnsupportedConstraint(
                    "token begin tags are not supported by the guidance backend"
                )
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
