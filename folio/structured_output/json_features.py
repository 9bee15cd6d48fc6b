"""JSON-schema features that xgrammar (0.2.9) accepts but does not enforce correctly.

xgrammar compiles these with at most a log warning: it drops length bounds next to a pattern
or format, and all but one allOf entry; and a length-bounded string compiles to a character
class that lets raw control characters (a tab, a newline) into the string — invalid JSON. Its
output may then not parse or validate, so the `auto` backend sends such schemas to guidance
(llguidance), which enforces them.
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
        if has_length:
            return "length-bounded strings (raw control characters slip in)"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            return "allOf with several subschemas"
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return None
