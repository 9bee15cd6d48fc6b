"""Mistral: ``[TOOL_CALLS]`` followed by either

* a JSON array (older tokenizers): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or
* name/args pairs (tokenizer v11+): ``[TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}``,
  optionally with ``[CALL_ID]id`` between name and ``[ARGS]`` (the id is ignored;
  OpenAI ids are generated here).
"""
from __future__ import annotations

import re

from .base import PartialCall, Segment, Text, ToolParser, expect, split_at_marker
from .granite import parse_marked_array
from .json_scan import INCOMPLETE, INVALID, scan_value, skip_ws

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        before, start = split_at_marker(text, 0, TOOL_CALLS, final)
        if start is None:
            return [Text(before)]
        j = skip_ws(text, start)
        if j >= len(text):
            return None if final else [Text(before)]
        if text[j] == "[":
            return parse_marked_array(text, TOOL_CALLS, final)
        segments: list[Segment] = [Text(before)]
        while True:
            m = _NAME.match(text, j)
            if m is None or m.end() == len(text):
                # no name yet, or the name may still grow
                return None if final or m is None and j < len(text) else segments
            k = m.end()
            if text.startswith(CALL_ID, k):
                k = text.find(ARGS, k)
                if k < 0:
                    return None if final else segments
            state = expect(text, k, ARGS, final)
            if state != "ok":
                return segments if state == "partial" or expect(
                    text, k, CALL_ID, final) == "partial" else None
            call = PartialCall(name=m.group())
            segments.append(call)
            k = skip_ws(text, k + len(ARGS))
            end = scan_value(text, k, final)
            if end == INVALID or (k < len(text) and text[k] != "{"):
                return None if final else segments[:-1]
            if end == INCOMPLETE:
                call.arguments = text[k:]
                return None if final else segments
            call.arguments, call.complete = text[k:end], True
            n = skip_ws(text, end)
            state = expect(text, n, TOOL_CALLS, final)
            if state == "ok":
                j = skip_ws(text, n + len(TOOL_CALLS))
                continue
            if state == "partial":
                return segments
            segments.append(Text(text[end:]))  # trailing content
            return segments
