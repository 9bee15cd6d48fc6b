"""A small incremental JSON scanner for tool-call payloads.

It finds where values start and end in possibly-truncated JSON without
building them, so streaming can forward the raw text of an ``arguments``
object as it grows. Final validity is still checked with ``json.loads``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .base import PartialCall

INCOMPLETE = -1  # the text ends before the value does
INVALID = -2  # the text can never become valid here

_WS = " \t\r\n"
# "unrolled loop" form: much faster than (?:[^"\\]|\\.)* on long strings
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_STRUCT_CHAR = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r'[^,\]}\s]*')
_JSON_SCALAR = re.compile(r'true|false|null|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?')
_CLOSER = {"}": "{", "]": "["}
ARG_KEYS = ("arguments", "parameters")


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int:
    """``s[i]`` is '"'; index after the closing quote, or INCOMPLETE."""
    end = _STRING_BODY.match(s, i + 1).end()
    return end + 1 if end < len(s) and s[end] == '"' else INCOMPLETE


def scan_value(s: str, i: int, final: bool) -> int:
    """End index (exclusive) of the JSON value starting at ``s[i]``."""
    if i >= len(s):
        return INCOMPLETE
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in "{[":
        stack = [c]
        j = i + 1
        while stack:
            m = _STRUCT_CHAR.search(s, j)
            if m is None:
                return INCOMPLETE
            j = m.start()
            ch = s[j]
            if ch == '"':
                j = scan_string(s, j)
                if j < 0:
                    return INCOMPLETE
                continue
            if ch in "{[":
                stack.append(ch)
            elif stack.pop() != _CLOSER[ch]:
                return INVALID
            j += 1
        return j
    end = _SCALAR.match(s, i).end()
    if end == len(s) and not final:
        return INCOMPLETE  # a number or literal may still be growing
    return end if _JSON_SCALAR.fullmatch(s, i, end) else INVALID


@dataclass
class ObjectScan:
    status: int  # end index when complete, else INCOMPLETE / INVALID
    fields: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start, end|INCOMPLETE)


def scan_object(s: str, i: int, final: bool) -> ObjectScan:
    """Scan a JSON object's top-level keys, recording each value's span."""
    out = ObjectScan(INCOMPLETE)
    if i >= len(s):
        return out
    if s[i] != "{":
        out.status = INVALID
        return out
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        out.status = j + 1
        return out
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return out
        if s[j] != '"':
            out.status = INVALID
            return out
        key_end = scan_string(s, j)
        if key_end < 0:
            return out
        key = json.loads(s[j:key_end])
        j = skip_ws(s, key_end)
        if j >= len(s):
            return out
        if s[j] != ":":
            out.status = INVALID
            return out
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return out
        end = scan_value(s, j, final)
        if end == INVALID:
            out.status = INVALID
            return out
        out.fields[key] = (j, end)
        if end == INCOMPLETE:
            return out
        j = skip_ws(s, end)
        if j >= len(s):
            return out
        if s[j] == ",":
            j += 1
        elif s[j] == "}":
            out.status = j + 1
            return out
        else:
            out.status = INVALID
            return out


def call_from_object(s: str, scan: ObjectScan) -> PartialCall | None:
    """Interpret a (partial) ``{"name": ..., "arguments"|"parameters": {...}}``.

    Returns None when it cannot be a call (wrong types, complete without name).
    """
    complete = scan.status >= 0
    name: str | None = None
    if "name" in scan.fields and scan.fields["name"][1] >= 0:
        start, end = scan.fields["name"]
        name = json.loads(s[start:end])
        if not isinstance(name, str):
            return None
    elif complete:
        return None
    args = "{}" if complete else ""
    for key in ARG_KEYS:
        if key not in scan.fields:
            continue
        start, end = scan.fields[key]
        if s[start] == '"':
            # Arguments sent as a JSON-encoded string: forward its decoded
            # text in one piece once the string is complete.
            args = json.loads(s[start:end]) if end >= 0 else ""
        elif s[start] == "{":
            args = s[start:end] if end >= 0 else s[start:]
        else:
            return None
        break
    return PartialCall(name=name, arguments=args, complete=complete)


@dataclass
class ArrayScan:
    status: int  # end index when complete, else INCOMPLETE / INVALID
    calls: list[PartialCall] = field(default_factory=list)


def scan_call_array(s: str, i: int, final: bool) -> ArrayScan:
    """Scan ``[{call}, {call}, ...]`` starting at ``s[i]``."""
    out = ArrayScan(INCOMPLETE)
    if i >= len(s):
        return out
    if s[i] != "[":
        out.status = INVALID
        return out
    j = i + 1
    while True:
        j = skip_ws(s, j)
        obj = scan_object(s, j, final)
        if obj.status == INVALID:
            out.status = INVALID
            return out
        call = call_from_object(s, obj)
        if call is None:
            out.status = INVALID
            return out
        out.calls.append(call)
        if obj.status == INCOMPLETE:
            return out
        j = skip_ws(s, obj.status)
        if j >= len(s):
            return out
        if s[j] == ",":
            j += 1
        elif s[j] == "]":
            out.status = j + 1
            return out
        else:
            out.status = INVALID
            return out
