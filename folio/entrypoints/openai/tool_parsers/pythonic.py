"""Pythonic calls: ``[f(a=1, b="x"), g()]`` (Llama 3.2 / Llama 4 style).

Llama 4 may wrap the list: ``<|python_start|>[...]<|python_end|>``, with text
around it. The bare form must be the whole output. Values are parsed with
``ast`` and converted from literal nodes only -- nothing is ever evaluated.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from .base import (PartialCall, Segment, Text, ToolParser, build_args, expect,
                   split_at_marker)
from .json_scan import INCOMPLETE, INVALID, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_SINGLE_BODY = {q: re.compile(rf"[^{q}\\]*(?:\\.[^{q}\\]*)*", re.DOTALL) for q in "'\""}
_JSON_NAMES = {"true": True, "false": False, "null": None}


def literal_value(src: str) -> Any:
    """Convert a Python (or JSON-ish) literal to a JSON-compatible value.

    Raises ValueError for anything that is not a plain literal.
    """
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(str(e)) from e
    return _convert(node)


def _convert(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and (
            node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_convert(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _convert(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")
            out[key] = _convert(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _convert(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("unary sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def _scan_py_string(s: str, j: int) -> int:
    q = s[j]
    if s.startswith(q * 3, j):
        k = j + 3
        while k < len(s):
            if s[k] == "\\":
                k += 2
            elif s.startswith(q * 3, k):
                return k + 3
            else:
                k += 1
        return INCOMPLETE
    k = _SINGLE_BODY[q].match(s, j + 1).end()
    return k + 1 if k < len(s) and s[k] == q else INCOMPLETE


def scan_py_value(s: str, i: int) -> int:
    """Index of the ',' or ')' that ends the argument value starting at ``s[i]``."""
    depth = 0
    j = i
    while j < len(s):
        c = s[j]
        if c in "\"'":
            j = _scan_py_string(s, j)
            if j < 0:
                return INCOMPLETE
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j if c == ")" else INVALID
            depth -= 1
        elif c == "," and depth == 0:
            return j
        j += 1
    return INCOMPLETE


@dataclass
class _ListScan:
    status: int  # end index when complete, else INCOMPLETE / INVALID
    calls: list[PartialCall] = field(default_factory=list)


def scan_call_list(s: str, i: int) -> _ListScan:
    """Scan ``[name(k=v, ...), ...]`` from ``s[i] == '['``."""
    out = _ListScan(INCOMPLETE)
    j = i + 1
    while True:
        j = skip_ws(s, j)
        m = _DOTTED.match(s, j)
        if m is None:
            out.status = INCOMPLETE if j >= len(s) else INVALID
            return out
        k = skip_ws(s, m.end())
        if k >= len(s) or s[k:] == ".":
            return out  # the (dotted) name may still grow
        if s[k] != "(":
            out.status = INVALID
            return out
        pairs: list[tuple[str, Any]] = []
        call = PartialCall(name=m.group(), arguments=build_args(pairs, False))
        out.calls.append(call)
        k += 1
        while True:
            k = skip_ws(s, k)
            if k >= len(s):
                return out
            if s[k] == ")":
                k += 1
                break
            km = _IDENT.match(s, k)
            if km is None or km.end() >= len(s):
                out.status = INCOMPLETE if km else INVALID
                return out
            k = skip_ws(s, km.end())
            if k >= len(s):
                return out
            if s[k] != "=":
                out.status = INVALID  # positional arguments have no name
                return out
            k = skip_ws(s, k + 1)
            end = scan_py_value(s, k)
            if end < 0:
                out.status = end
                return out
            try:
                pairs.append((km.group(), literal_value(s[k:end])))
            except ValueError:
                out.status = INVALID
                return out
            call.arguments = build_args(pairs, False)
            k = end + 1 if s[end] == "," else end
        call.arguments, call.complete = build_args(pairs, True), True
        j = skip_ws(s, k)
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


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        i = skip_ws(text, 0)
        if i >= len(text):
            return [Text(text)] if final else []
        if text[i] == "[":  # bare list: must be the whole output
            scan = scan_call_list(text, i)
            if scan.status == INVALID and not scan.calls:
                return [Text(text)]  # e.g. "[1] see note": plain content
            if scan.status < 0:
                return None if final else scan.calls
            tail = text[scan.status:]
            if tail.strip():
                return None if final else scan.calls
            return scan.calls
        before, start = split_at_marker(text, 0, START, final)
        segments: list[Segment] = [Text(before)]
        if start is None:
            return segments
        j = skip_ws(text, start)
        if j < len(text) and text[j] != "[":
            return None if final else segments
        scan = scan_call_list(text, j) if j < len(text) else _ListScan(INCOMPLETE)
        segments.extend(scan.calls)
        if scan.status < 0:
            return None if final else segments
        k = skip_ws(text, scan.status)
        state = expect(text, k, END, final)
        if state == "ok":
            segments.append(Text(text[k + len(END):]))
        elif state == "no":
            return None if final else segments
        return segments
