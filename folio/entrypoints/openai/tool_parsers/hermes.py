"""Hermes / Qwen2.5 style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Several calls may appear, with plain text before, between and after them.
The closing tag may be missing at the very end (the model stopped on EOS).
"""
from __future__ import annotations

from .base import Segment, Text, ToolParser, expect, split_at_marker
from .json_scan import INVALID, call_from_object, scan_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        segments: list[Segment] = []
        pos = 0
        while True:
            before, start = split_at_marker(text, pos, START, final)
            segments.append(Text(before))
            if start is None:
                return segments
            obj = scan_object(text, skip_ws(text, start), final)
            call = call_from_object(text, obj) if obj.status != INVALID else None
            if call is None:
                # Not a call: hold while streaming; finish() falls back to content.
                return None if final else segments
            segments.append(call)
            if obj.status < 0:
                return None if final else segments
            k = skip_ws(text, obj.status)
            found = expect(text, k, END, final)
            if found == "ok":
                pos = k + len(END)
                continue
            if found == "eof":
                return segments
            # 'partial': wait for the rest of the end tag; 'no': malformed.
            return None if final else segments



