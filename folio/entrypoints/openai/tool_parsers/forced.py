"""Parsers for forced tool calls (tool_choice "required" or a named function).

A grammar shapes that output (folio.entrypoints.openai.request_constraints), so these parse
a fixed form rather than a model's own format:
* required: a JSON array of ``{"name": ..., "parameters": {...}}`` objects;
* named: the whole output is the arguments object of the chosen function.
They plug into the same streaming machinery as the format parsers: id and name first, then
argument fragments.
"""
from __future__ import annotations

from typing import Any

from .base import PartialCall, Segment, ToolParser
from .json_scan import INCOMPLETE, INVALID, call_from_object, scan_object, scan_value, skip_ws


class RequiredToolCallParser(ToolParser):
    name = "required"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        failed: list[Segment] | None = None if final else []
        i = skip_ws(text, 0)
        if i >= len(text):
            return failed
        if text[i] != "[":
            return None
        i = skip_ws(text, i + 1)
        segments: list[Segment] = []
        while True:
            if i >= len(text):
                return None if final else segments
            obj = scan_object(text, i, final)
            call = call_from_object(text, obj) if obj.status != INVALID else None
            if call is None:
                return None if final else segments
            segments.append(call)
            if obj.status < 0:
                return None if final else segments
            k = skip_ws(text, obj.status)
            if k >= len(text):
                return None if final else segments
            if text[k] == "]":
                return segments
            if text[k] != ",":
                return None if final else segments
            i = skip_ws(text, k + 1)


class NamedToolCallParser(ToolParser):
    name = "named"

    def __init__(self, tools: list[dict] | None = None, *, function_name: str,
                 **kwargs: Any) -> None:
        super().__init__(tools, **kwargs)
        self.function_name = function_name

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        i = skip_ws(text, 0)
        end = scan_value(text, i, final) if i < len(text) else INCOMPLETE
        if end == INVALID:
            return None if final else []
        if end >= 0:
            return [PartialCall(self.function_name, text[i:end], complete=True)]
        if final:
            return None  # cut off (max_tokens) before the arguments closed
        return [PartialCall(self.function_name, text[i:], complete=False)]
