"""JSON-schema features that xgrammar accepts but does not enforce.

xgrammar compiles these with only a log warning and drops the constraint, so its output may
not validate. The `auto` backend sends such schemas to guidance (llguidance) instead, which
enforces them.
"""
from __future__ import annotations

from typing import Any

_LENGTH = ("minLength", "maxLength")


def xgrammar_unenforced_feature(schema: Any) -> str | None:
    """A description of the first construct xgrammar would silently ignore, or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        has_length = any(k in node for k in _LENGTH)
        if has_length and "pattern" in node:
            return "pattern combined with minLength/maxLength"
        if has_length and "format" in node:
            return "format combined with minLength/maxLength"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return "allOf with several subschemas"
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return None
