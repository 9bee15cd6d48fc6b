"""DeepSeek V3 / R1 tool calls (and the V3.1 variant).

V3:   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
Told apart by what follows the separator: ``{`` means V3.1.
"""
from __future__ import annotations

from .base import PartialCall, Segment, Text, ToolParser, expect, split_at_marker
from .json_scan import INCOMPLETE, INVALID, scan_value, skip_ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        before, start = split_at_marker(text, 0, CALLS_BEGIN, final)
        segments: list[Segment] = [Text(before)]
        if start is None:
            return segments
        j = start
        hold = None if final else segments  # what to return when we must wait
        while True:
            j = skip_ws(text, j)
            if text.startswith(CALLS_END, j):
                segments.append(Text(text[j + len(CALLS_END):]))
                return segments
            state = expect(text, j, CALL_BEGIN, final)
            if state != "ok":
                if state == "partial" or expect(text, j, CALLS_END, final) == "partial":
                    return segments
                # tolerate a missing calls-end marker at the very end
                return segments if state == "eof" and len(segments) > 1 else None
            j += len(CALL_BEGIN)
            sep = text.find(SEP, j)
            if sep < 0:
                return hold
            k = skip_ws(text, sep + len(SEP))
            if k >= len(text):
                return hold
            fenced = text[k] != "{"
            if fenced:  # V3: name on the line after the separator, then ```json
                nl = text.find("\n", sep + len(SEP))
                if nl < 0:
                    return hold
                name = text[sep + len(SEP):nl].strip()
                k = skip_ws(text, nl)
                state = expect(text, k, FENCE, final)
                if state != "ok":
                    return segments if state == "partial" else None
                k += len(FENCE)
                if text.startswith("json", k):
                    k += 4
                elif not final and "json".startswith(text[k:]):
                    return segments
                k = skip_ws(text, k)
            else:
                name = text[j:sep].strip()
            if not name:
                return None if final else segments
            call = PartialCall(name=name)
            segments.append(call)
            if k >= len(text):
                return hold
            if text[k] != "{":
                return None if final else segments
            end = scan_value(text, k, final)
            if end == INVALID:
                return None if final else segments
            if end == INCOMPLETE:
                call.arguments = text[k:]
                return hold
            call.arguments, call.complete = text[k:end], True
            j = skip_ws(text, end)
            if fenced:
                state = expect(text, j, FENCE, final)
                if state == "ok":
                    j = skip_ws(text, j + len(FENCE))
                elif state == "partial":
                    return segments
            state = expect(text, j, CALL_END, final)
            if state == "ok":
                j += len(CALL_END)
            elif state == "partial":
                return segments
            elif state == "eof":
                return segments
            else:
                return None if final else segments
