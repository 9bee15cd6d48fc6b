"""Anthropic's Messages API response bodies, as plain dicts and SSE strings: the message,
its content blocks, stop_reason, usage, the streaming events (with `event:` lines), and the
error body. Pure functions and one small state machine (ContentBlockEvents); no engine, no
request."""
from __future__ import annotations

import json
from typing import Any, Sequence

# Anthropic's error type for each HTTP status it uses.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def error_status_and_body(status_code: int, message: str) -> tuple[int, dict[str, Any]]:
    """Anthropic's {"type": "error", "error": {...}} for an error of `status_code`. A 503
    (the engine unavailable or shutting down) goes out as Anthropic's 529 overloaded_error,
    which its clients know to retry."""
    status = 529 if status_code == 503 else status_code
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                        else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def tool_use_id(call_id: str) -> str:
    """The parsers' OpenAI-style id ("call_" + 24 alphanumerics) in Anthropic's form."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from the cache apart: input_tokens +
    cache_read_input_tokens (+ cache_creation_input_tokens, 0: folio's prefix cache is
    automatic and free to write) is the whole prompt."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def stop_reason(finish_reason: str | None, matched: int | str | None,
                stop_sequences: Sequence[str] | None, *, tool_called: bool,
                context_full: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish. `matched`: the stop string (or
    token id) that ended it; `context_full`: the output ran into the context's end before
    the requested max_tokens."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if context_full else "max_tokens"), None
    if tool_called:
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    # Anthropic signs thinking so it can be checked when sent back; folio has nothing to sign
    # with, and ignores the signature of thinking it is sent.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(block_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id, "name": name,
            "input": json.loads(arguments) if isinstance(arguments, str) else arguments}


def content_blocks(reasoning: str | None, text: str | None,
                   calls: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """thinking, then text, then one tool_use per (id, name, arguments JSON); a reply with
    none of them is one empty text block (clients read content[0])."""
    blocks = []
    if reasoning:
        blocks.append(thinking_block(reasoning))
    if text:
        blocks.append(text_block(text))
    blocks += [tool_use_block(*call) for call in calls]
    return blocks or [text_block("")]


def message(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
            sequence: str | None, usage_body: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body}


# ---- streaming --------------------------------------------------------------------------

def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event; Anthropic's carry the event's type in an `event:` line too."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def message_start(message_id: str, model: str, usage_body: dict[str, int]) -> str:
    return sse("message_start", {"type": "message_start", "message": message(
        message_id, model, [], None, None, usage_body)})


PING = sse("ping", {"type": "ping"})
MESSAGE_STOP = sse("message_stop", {"type": "message_stop"})


def message_delta(reason: str, sequence: str | None, output_tokens: int) -> str:
    return sse("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": {"output_tokens": output_tokens}})


def error_event(status_code: int, message_text: str) -> str:
    return sse("error", error_status_and_body(status_code, message_text)[1])


class ContentBlockEvents:
    """The content-block events of one streamed reply. Blocks are sent one after another:
    a piece of another kind (thinking, text, a tool call) closes the open block and starts
    the next, with the next index."""

    def __init__(self) -> None:
        self._index = -1
        self._open: tuple[str, int] | None = None  # (kind, tool-call index)
        self.tool_called = False

    def _start(self, kind: str, key: int, block: dict[str, Any]) -> list[str]:
        events = self._stop()
        self._index += 1
        self._open = (kind, key)
        events.append(sse("content_block_start", {"type": "content_block_start",
                                                  "index": self._index,
                                                  "content_block": block}))
        return events

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                           "delta": delta})

    def thinking(self, text: str) -> list[str]:
        events = [] if self._open == ("thinking", 0) else self._start(
            "thinking", 0, {"type": "thinking", "thinking": "", "signature": ""})
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        events = [] if self._open == ("text", 0) else self._start("text", 0, text_block(""))
        return events + [self._delta({"type": "text_delta", "text": text})]

    def tool_start(self, key: int, block_id: str, name: str) -> list[str]:
        """A new call (the parser's call index `key`): its input follows as JSON text."""
        self.tool_called = True
        return self._start("tool_use", key, {"type": "tool_use", "id": block_id, "name": name,
                                             "input": {}})

    def tool_input(self, key: int, partial_json: str) -> list[str]:
        if self._open != ("tool_use", key):
            return []  # a fragment of a call that was not started (or was dropped)
        return [self._delta({"type": "input_json_delta", "partial_json": partial_json})]

    def close(self) -> list[str]:
        """Stop the open block; a reply that sent none gets one empty text block."""
        if self._index < 0:
            return self._start("text", 0, text_block("")) + self._stop()
        return self._stop()
