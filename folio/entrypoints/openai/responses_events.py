"""The Responses API's streaming events, as SSE strings with `event:` lines: the response's
lifecycle (response.created, .in_progress, .completed / .incomplete / .failed), and each output
item's events (output_item.added, content_part.added, the deltas, their .done events,
content_part.done, output_item.done), every one numbered by `sequence_number`.

ResponseEvents is one small state machine per response: it grows the record's output items as
the deltas come, so the final response object holds exactly what the events said, and a
background response polled mid-run shows its output so far.
"""
from __future__ import annotations

import json
from typing import Any

from folio.entrypoints.openai.responses_protocol import FUNCTION_CALL, MESSAGE, REASONING
from folio.entrypoints.openai.responses_output import (ITEM_COMPLETED, ITEM_IN_PROGRESS,
                                                       ResponseRecord,
                                                       call_item_id, function_call_item,
                                                       message_item, new_item_id,
                                                       output_text_part, reasoning_item,
                                                       reasoning_text_part)

# The lifecycle events' types.
RESPONSE_CREATED = "response.created"
RESPONSE_IN_PROGRESS = "response.in_progress"
RESPONSE_COMPLETED = "response.completed"
RESPONSE_INCOMPLETE = "response.incomplete"
RESPONSE_FAILED = "response.failed"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event; the Responses API names each event in an `event:` line too."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """The events of one response's run. Items are sent one after another: a piece of another
    kind (reasoning, text, a tool call) closes the open item and adds the next."""

    def __init__(self, record: ResponseRecord, max_calls: int | None = None) -> None:
        self.record = record
        # Calls past this many (parallel_tool_calls false: 1; max_tool_calls) are dropped.
        self.max_calls = max_calls
        self._sequence = 0
        self._open: tuple[str, int] | None = None  # (kind, tool-call index)
        self._item: dict[str, Any] = {}
        self._calls = 0

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(payload)

    def lifecycle(self, kind: str) -> str:
        """response.created / .in_progress / .completed ...: the whole response as it is."""
        return self._event(kind, response=self.record.body())

    @property
    def _index(self) -> int:
        return len(self.record.output) - 1

    def _add(self, kind: str, key: int, item: dict[str, Any]) -> list[str]:
        events = self._close(ITEM_COMPLETED)
        self._open = (kind, key)
        self._item = item
        self.record.output.append(item)
        events.append(self._event("response.output_item.added", output_index=self._index,
                                  item=item))
        return events

    def _part(self, part: dict[str, Any]) -> str:
        self._item["content"].append(part)
        return self._event("response.content_part.added", item_id=self._item["id"],
                           output_index=self._index, content_index=0, part=part)

    def _close(self, status: str) -> list[str]:
        if self._open is None:
            return []
        kind, item, index = self._open[0], self._item, self._index
        self._open = None
        events = []
        if kind in (MESSAGE, REASONING):
            part = item["content"][0]
            text = part["text"]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if kind == MESSAGE:
                events.append(self._event("response.output_text.done", **where, text=text,
                                          logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", **where, text=text))
            events.append(self._event("response.content_part.done", **where, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
        item["status"] = status if kind == MESSAGE else ITEM_COMPLETED
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def reasoning(self, delta: str) -> list[str]:
        events: list[str] = []
        if self._open != (REASONING, 0):
            events = self._add(REASONING, 0, reasoning_item(new_item_id(REASONING), None,
                                                             ITEM_IN_PROGRESS))
            events.append(self._part(reasoning_text_part("")))
        self._item["content"][0]["text"] += delta
        events.append(self._event("response.reasoning_text.delta", item_id=self._item["id"],
                                  output_index=self._index, content_index=0, delta=delta))
        return events

    def _open_message(self) -> list[str]:
        events = self._add(MESSAGE, 0, message_item(new_item_id(MESSAGE), None,
                                                    ITEM_IN_PROGRESS))
        return events + [self._part(output_text_part(""))]

    def text(self, delta: str) -> list[str]:
        events = self._open_message() if self._open != (MESSAGE, 0) else []
        self._item["content"][0]["text"] += delta
        events.append(self._event("response.output_text.delta", item_id=self._item["id"],
                                  output_index=self._index, content_index=0, delta=delta,
                                  logprobs=[]))
        return events

    def call_start(self, key: int, call_id: str, name: str) -> list[str]:
        """A new call (the parser's call index `key`); its arguments follow as JSON text."""
        if self.max_calls is not None and self._calls >= self.max_calls:
            return []
        self._calls += 1
        item = function_call_item(call_item_id(call_id), call_id, name, "", ITEM_IN_PROGRESS)
        return self._add(FUNCTION_CALL, key, item)

    def call_arguments(self, key: int, delta: str) -> list[str]:
        if self._open != (FUNCTION_CALL, key):
            return []  # a fragment of a call that was not started (or was dropped)
        self._item["arguments"] += delta
        return [self._event("response.function_call_arguments.delta", item_id=self._item["id"],
                            output_index=self._index, delta=delta)]

    def close(self, message_status: str) -> list[str]:
        """Close the open item (a message with `message_status`: incomplete when the output
        ran out of tokens); a reply that sent nothing gets one empty message."""
        events = self._open_message() if not self.record.output else []
        return events + self._close(message_status)
