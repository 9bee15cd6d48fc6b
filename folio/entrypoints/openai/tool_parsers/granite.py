"""IBM Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``."""
from __future__ import annotations

from .base import Segment, Text, ToolParser, split_at_marker
from .json_scan import scan_call_array, skip_ws

MARKER = "<|tool_call|>"


def parse_marked_array(text: str, marker: str, final: bool) -> list[Segment] | None:
    """``content marker [calls...] trailing-content`` (shared with mistral)."""
    before, start = split_at_marker(text, 0, marker, final)
    segments: list[Segment] = [Text(before)]
    if start is None:
        return segments
    scan = scan_call_array(text, skip_ws(text, start), final)
    if scan.status < 0:
        if final:
            return None
        # Keep only calls that can still be valid; the rest is held.
        return segments + scan.calls
    segments.extend(scan.calls)
    segments.append(Text(text[scan.status:]))
    return segments


class GraniteToolParser(ToolParser):
    name = "granite"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        return parse_marked_array(text, MARKER, final)
