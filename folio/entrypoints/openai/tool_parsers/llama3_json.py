"""Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``.

Optionally preceded by ``<|python_tag|>`` (text may come before the tag);
several calls are separated by ``;``. Without the tag the output must start
with ``{``, and a JSON object that is not a call stays plain content.
"""
from __future__ import annotations

from .base import Segment, Text, ToolParser, split_at_marker
from .json_scan import INVALID, call_from_object, scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        i = skip_ws(text, 0)
        if i >= len(text):
            return [Text(text)] if final else []
        tagged = text[i] != "{"
        segments: list[Segment] = []
        if tagged:
            # Only look for the tag outside JSON, so a tag inside a string
            # argument is not mistaken for a new call.
            before, start = split_at_marker(text, 0, PYTHON_TAG, final)
            segments.append(Text(before))
            if start is None:
                return segments
            i = skip_ws(text, start)
        while True:
            obj = scan_object(text, i, final)
            call = call_from_object(text, obj) if obj.status != INVALID else None
            if call is None:
                if not tagged and not segments:
                    return [Text(text)]  # plain JSON answer, not a call
                return None if final else segments
            segments.append(call)
            if obj.status < 0:
                return None if final else segments
            k = skip_ws(text, obj.status)
            if k >= len(text):
                return segments
            if text[k] != ";":
                return None if final else segments
            i = skip_ws(text, k + 1)
            if i >= len(text):
                return segments  # a trailing ";" is tolerated
