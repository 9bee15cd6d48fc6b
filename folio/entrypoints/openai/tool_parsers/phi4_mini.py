"""Phi-4-mini: ``functools[{"name": ..., "arguments": {...}}, ...]``.

One JSON list of calls after the ``functools`` marker (no closing marker); the
arguments key may also be ``parameters``. Text before the marker and after the
list is content. ``functools`` is an ordinary word too (Python's module), so
the marker only opens calls when a ``[`` follows it (whitespace allowed
between); otherwise it stays content and the search goes on. A list after the
marker that is not calls makes the whole output content.
"""
from __future__ import annotations

from .base import Segment, Text, ToolParser, split_at_marker
from .json_scan import INCOMPLETE, INVALID, scan_call_array, skip_ws

MARKER = "functools"


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        pos = 0
        while True:
            tail, start = split_at_marker(text, pos, MARKER, final)
            if start is None:
                # no (further) marker: all content, less a trailing partial
                # marker while streaming
                return [Text(text[:pos] + tail)]
            marker_at = start - len(MARKER)
            k = skip_ws(text, start)
            if k >= len(text):
                # the marker ends the text: a list may still follow
                return [Text(text)] if final else [Text(text[:marker_at])]
            if text[k] != "[":
                pos = start  # just the word: keep looking
                continue
            segments: list[Segment] = [Text(text[:marker_at])]
            scan = scan_call_array(text, k, final)
            if scan.status == INVALID:
                return None if final else segments
            segments.extend(scan.calls)
            if scan.status == INCOMPLETE:
                return None if final else segments
            segments.append(Text(text[scan.status:]))
            return segments
