"""Limits on the request fields that size work, checked in the front end before anything is
allocated (the server's API process, or LLM offline).

Each check raises ValueError whose message starts with the offending field's name, so the
server turns it into a 400 naming the field and offline callers see which field to fix. The
bounds themselves are `RequestLimitsConfig` (engine flags `--max-n`, `--max-logprobs`, ...).
"""
from __future__ import annotations

import json
from typing import Any

from folio.config import RequestLimitsConfig
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether dicts/lists nest deeper than `limit` levels in `value` (iterative: a hostile
    depth cannot overflow the stack). A scalar has depth 0, `[]` depth 1."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _check_count(name: str, items: Any, limit: int, what: str, flag: str) -> None:
    if items is not None and len(items) > limit:
        raise ValueError(f"{name} has {len(items)} {what}; at most {limit} are allowed ({flag})")


def check_constraint_limits(so: StructuredOutputsParams, limits: RequestLimitsConfig,
                            field: str = "structured_outputs") -> None:
    """Size and nesting of a constraint, before any backend parses it (a parser can take
    seconds, or overflow its stack, on a hostile schema)."""
    texts: list[str] = []
    schemas: list[Any] = []
    if so.json is not None:
        if isinstance(so.json, str):
            texts.append(so.json)
            try:
                schemas.append(json.loads(so.json))
            except (ValueError, RecursionError):
                pass  # not JSON: the constraint's own validation says so
        else:
            if json_depth_exceeds(so.json, limits.max_schema_depth):
                raise ValueError(f"{field}: the JSON schema nests deeper than "
                                 f"{limits.max_schema_depth} levels (--max-schema-depth)")
            try:
                texts.append(json.dumps(so.json))
            except (ValueError, TypeError):
                pass  # not serializable: the constraint's own validation says so
    for text in (so.regex, so.grammar, so.structural_tag, so.whitespace_pattern):
        if isinstance(text, str):
            texts.append(text)
    if so.structural_tag is not None:
        try:
            schemas.append(json.loads(so.structural_tag))
        except (ValueError, RecursionError):
            pass
    if so.choice is not None:
        texts.extend(c for c in so.choice if isinstance(c, str))
    size = sum(len(t.encode("utf-8", "replace")) for t in texts)
    if size > limits.max_schema_bytes:
        raise ValueError(f"{field}: the constraint is {size} bytes; at most "
                         f"{limits.max_schema_bytes} are allowed (--max-schema-bytes)")
    for schema in schemas:
        if json_depth_exceeds(schema, limits.max_schema_depth):
            raise ValueError(f"{field}: the JSON schema nests deeper than "
                             f"{limits.max_schema_depth} levels (--max-schema-depth)")


def check_sampling_limits(params: SamplingParams, limits: RequestLimitsConfig) -> None:
    """Every SamplingParams field that sizes work, against the configured bounds."""
    if params.n > limits.max_n:
        raise ValueError(f"n must be at most {limits.max_n} (--max-n), got {params.n}")
    if limits.max_logprobs != -1:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and (value == -1 or value > limits.max_logprobs):
                raise ValueError(f"{name} must be at most {limits.max_logprobs} "
                                 f"(--max-logprobs), got {value}")
    _check_count("stop", params.stop, limits.max_stop_strings, "strings", "--max-stop-strings")
    for s in params.stop or ():
        if len(s) > limits.max_stop_string_chars:
            raise ValueError(f"stop strings must be at most {limits.max_stop_string_chars} "
                             f"characters (--max-stop-string-chars), got one of {len(s)}")
    _check_count("logit_bias", params.logit_bias, limits.max_logit_bias_entries, "entries",
                 "--max-logit-bias-entries")
    _check_count("allowed_token_ids", params.allowed_token_ids, limits.max_token_id_list,
                 "ids", "--max-token-id-list")
    _check_count("stop_token_ids", params.stop_token_ids, limits.max_token_id_list, "ids",
                 "--max-token-id-list")
    _check_count("bad_words", params.bad_words, limits.max_bad_words, "words",
                 "--max-bad-words")
    for word in params.bad_words or ():
        if len(word) > limits.max_bad_word_chars:
            raise ValueError(f"bad_words must be at most {limits.max_bad_word_chars} characters "
                             f"each (--max-bad-word-chars), got one of {len(word)}")
    if params.structured_outputs is not None:
        check_constraint_limits(params.structured_outputs, limits)


def check_kv_fit(prompt_len: int, params: SamplingParams, max_model_len: int,
                 kv_capacity_tokens: int | None) -> None:
    """A request whose n sequences (prompt + max_tokens each) cannot all be held by the KV
    cache at once would thrash it by preemption: refuse it now instead. One sequence always
    fits (start-up checks the cache holds max_model_len tokens)."""
    if kv_capacity_tokens is None or params.n == 1:
        return
    # The engine clamps max_tokens to the room the prompt leaves (core.request.Request).
    room = max_model_len - prompt_len
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    needed = params.n * (prompt_len + max_tokens)
    if needed > kv_capacity_tokens:
        raise ValueError(
            f"n={params.n} sequences of {prompt_len} prompt + {max_tokens} output tokens need "
            f"{needed} tokens of KV cache, which holds {kv_capacity_tokens}; lower n or "
            f"max_tokens")
