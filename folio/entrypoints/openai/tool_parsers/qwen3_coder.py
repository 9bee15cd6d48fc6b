"""Qwen3-Coder XML calls (``qwen3_xml``)::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text; they are converted using the type declared for the
parameter in the request's ``tools`` schema (strings when unknown). Arguments
stream one completed parameter at a time.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .base import (PartialCall, Segment, Text, ToolParser, build_args, expect,
                   split_at_marker)
from .json_scan import skip_ws
from .pythonic import literal_value

TC_START, TC_END = "<tool_call>", "</tool_call>"
FN_START, FN_END = "<function=", "</function>"
P_START, P_END = "<parameter=", "</parameter>"
_INT = re.compile(r"[+-]?\d+")


def _schema_types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if isinstance(sub, dict):
                out.extend(_schema_types(sub))
    return out


def convert_value(value: str, schema: dict[str, Any] | None) -> Any:
    """Convert raw parameter text by its JSON-schema type; fall back to the string."""
    types = _schema_types(schema or {})
    if not types or "string" in types:
        return value
    v = value.strip()
    if v.lower() in ("null", "none"):
        return None
    for t in types:
        try:
            if t == "integer":
                if _INT.fullmatch(v):
                    return int(v)
                f = float(v)
                if f.is_integer():
                    return int(f)
            elif t == "number":
                return int(v) if _INT.fullmatch(v) else float(v)
            elif t == "boolean":
                if v.lower() in ("true", "false"):
                    return v.lower() == "true"
            elif t in ("object", "array"):
                try:
                    return json.loads(v)
                except ValueError:
                    return literal_value(v)
        except (ValueError, OverflowError):
            continue
    return value


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_xml"

    def _param_schema(self, function: str, param: str) -> dict[str, Any] | None:
        props = self.tool_schema(function).get("properties")
        return props.get(param) if isinstance(props, dict) else None

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        segments: list[Segment] = []
        pos = 0
        while True:
            before, start = split_at_marker(text, pos, TC_START, final)
            segments.append(Text(before))
            if start is None:
                return segments
            k = skip_ws(text, start)
            state = expect(text, k, FN_START, final)
            if state != "ok":
                return segments if state == "partial" else None
            k += len(FN_START)
            gt = text.find(">", k)
            if gt < 0:
                return None if final else segments
            name = text[k:gt].strip()
            if not name:
                return None if final else segments
            pairs: list[tuple[str, Any]] = []
            call = PartialCall(name=name, arguments=build_args(pairs, False))
            segments.append(call)
            k = gt + 1
            while True:
                k = skip_ws(text, k)
                if text.startswith(FN_END, k):
                    k += len(FN_END)
                    break
                if not text.startswith(P_START, k):
                    if not final and (FN_END.startswith(text[k:]) or P_START.startswith(text[k:])):
                        return segments
                    return None if final else segments
                p = k + len(P_START)
                gt = text.find(">", p)
                if gt < 0:
                    return None if final else segments
                pname = text[p:gt].strip()
                value_end, k = self._value_end(text, gt + 1)
                if value_end < 0:
                    return None if final else segments
                value = text[gt + 1:value_end]
                # The template puts each value on its own lines.
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                pairs.append((pname, convert_value(value, self._param_schema(name, pname))))
                call.arguments = build_args(pairs, False)
            call.arguments, call.complete = build_args(pairs, True), True
            k = skip_ws(text, k)
            state = expect(text, k, TC_END, final)
            if state == "ok":
                pos = k + len(TC_END)
                continue
            if state == "eof" or state == "partial":
                return segments
            return None if final else segments

    @staticmethod
    def _value_end(text: str, start: int) -> tuple[int, int]:
        """(end of the value, where parsing resumes); (-1, -1) if not ended yet.

        ``</parameter>`` normally ends a value; a missing one is tolerated when
        the next parameter or ``</function>`` follows.
        """
        end = text.find(P_END, start)
        alts = [i for i in (text.find(P_START, start), text.find(FN_END, start)) if i >= 0]
        alt = min(alts) if alts else -1
        if end >= 0 and (alt < 0 or end <= alt):
            return end, end + len(P_END)
        if alt >= 0:
            return alt, alt
        return -1, -1
