"""The Responses API's response object and its output items, as plain dicts in OpenAI's wire
format: ids, message / reasoning / function_call items, usage, and ResponseRecord (one
response's state, from queued to its final status). Pure functions and one dataclass; no
engine, no request."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from folio.entrypoints.openai.responses_protocol import (FUNCTION_CALL, FUNCTION_CALL_OUTPUT,
                                                         MESSAGE, REASONING)

# Id prefixes, OpenAI's: a response, and each kind of item.
RESPONSE_ID_PREFIX = "resp_"
_ITEM_ID_PREFIXES = {MESSAGE: "msg_", REASONING: "rs_", FUNCTION_CALL: "fc_",
                     FUNCTION_CALL_OUTPUT: "fco_"}

# A response's status.
QUEUED = "queued"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
INCOMPLETE = "incomplete"
CANCELLED = "cancelled"
FAILED = "failed"
FINAL_STATUSES = frozenset({COMPLETED, INCOMPLETE, CANCELLED, FAILED})

# An output item's status.
ITEM_IN_PROGRESS = "in_progress"
ITEM_COMPLETED = "completed"
ITEM_INCOMPLETE = "incomplete"

# incomplete_details.reason when the output ran out of tokens (the client's max_output_tokens,
# or the room the context left).
MAX_OUTPUT_TOKENS = "max_output_tokens"


def new_response_id() -> str:
    return RESPONSE_ID_PREFIX + uuid.uuid4().hex


def new_item_id(kind: str) -> str:
    return _ITEM_ID_PREFIXES[kind] + uuid.uuid4().hex


def with_item_ids(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items, each with an id (input items may come without one; the stored conversation
    and /input_items list them by id)."""
    return [item if item.get("id") else {**item, "id": new_item_id(item.get("type", MESSAGE))}
            for item in items]


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message; None: opened, its content part not yet added (streaming)."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": MESSAGE, "status": status, "role": "assistant",
            "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    # The reasoning is the model's own text (`content`); folio writes no summaries.
    content = [] if text is None else [reasoning_text_part(text)]
    return {"id": item_id, "type": REASONING, "status": status, "summary": [],
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": FUNCTION_CALL, "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def call_item_id(call_id: str) -> str:
    """A function_call item's id from its call id (the parsers' "call_" + 24 characters)."""
    return _ITEM_ID_PREFIXES[FUNCTION_CALL] + call_id.removeprefix("call_")


def output_items(reasoning: str | None, text: str | None,
                 calls: Sequence[tuple[str, str, str]], incomplete: bool
                 ) -> list[dict[str, Any]]:
    """reasoning, then the message, then one function_call per (call id, name, arguments):
    the order OpenAI's are in. A reply with nothing else is one empty message (clients read
    output_text); reasoning alone (the output ran out while reasoning) is not given an empty
    message, as OpenAI's and as the stream (responses_events) does."""
    status = ITEM_INCOMPLETE if incomplete else ITEM_COMPLETED
    items = []
    if reasoning:
        items.append(reasoning_item(new_item_id(REASONING), reasoning, status))
    if text or not (calls or reasoning):
        items.append(message_item(new_item_id(MESSAGE), text or "", status))
    items += [function_call_item(call_item_id(call_id), call_id, name, arguments,
                                 ITEM_COMPLETED) for call_id, name, arguments in calls]
    return items


def usage(input_tokens: int, cached_tokens: int, output_tokens: int,
          reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def error_body(status_code: int, message: str) -> dict[str, str]:
    """The response object's `error` for a response that failed after it was accepted; the
    code is one of OpenAI's ResponseError codes."""
    code = {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(status_code, "server_error")
    return {"code": code, "message": message}


@dataclass
class ResponseRecord:
    """One response: what the request fixed (`echo`: the fields the object repeats) and what
    the run fills in. The output items are dicts the streaming side grows in place, so a
    background response polled mid-run shows its output so far."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = QUEUED
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    completed_at: int | None = None

    def finish(self, status: str, *, error: dict[str, str] | None = None) -> None:
        self.status = status
        self.error = error
        if status in (CANCELLED, FAILED):
            for item in self.output:  # the item the run was writing when it stopped
                if item["status"] == ITEM_IN_PROGRESS:
                    item["status"] = ITEM_INCOMPLETE
        if status == INCOMPLETE:
            self.incomplete_details = {"reason": MAX_OUTPUT_TOKENS}
        if status == COMPLETED:
            self.completed_at = int(time.time())

    def body(self) -> dict[str, Any]:
        """The response object (serialize it before the next await: the run goes on)."""
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "completed_at": self.completed_at,
                "error": self.error, "incomplete_details": self.incomplete_details,
                "model": self.model, "output": list(self.output), "usage": self.usage,
                **self.echo}
