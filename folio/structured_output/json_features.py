"""JSON-schema features that xgrammar (0.2.9) accepts but does not enforce correctly.

xgrammar compiles these with at most a log warning, so its output may not validate:

- it drops length bounds next to a pattern or format, and all but one allOf entry;
- a length-bounded string compiles to a character class that lets raw control characters
  (a tab, a newline) into the string: invalid JSON;
- it enforces a oneOf as anyOf unless it can prove the branches disjoint;
- it ignores `not`, `uniqueItems`, `if`/`then`/`else`, `contains` (and its bounds),
  `dependentRequired`, `dependentSchemas` and `dependencies` altogether.

The `auto` backend sends such schemas to guidance (llguidance, in strict mode), which either
enforces them or rejects them naming the keyword; see compilers.resolve_route.
Only schema positions are searched (not `enum`/`const`/`default` values, not property names).
"""
from __future__ import annotations

from typing import Any

from folio.structured_output.params import _SUBSCHEMA_LIST, _SUBSCHEMA_MAP, _SUBSCHEMA_ONE

__all__ = ["xgrammar_unenforced_feature", "xgrammar_unenforced_features"]

_LENGTH = ("minLength", "maxLength")
# Keywords xgrammar compiles without enforcing at all (checked against xgrammar 0.2.9).
_IGNORED = ("not", "uniqueItems", "if", "then", "else", "contains", "minContains",
            "maxContains", "dependentRequired", "dependentSchemas", "dependencies")


def _node_features(node: dict) -> list[str]:
    found = []
    has_length = any(k in node for k in _LENGTH)
    if has_length and "pattern" in node:
        found.append("`pattern` combined with `minLength`/`maxLength`")
    elif has_length and "format" in node:
        found.append("`format` combined with `minLength`/`maxLength`")
    elif has_length:
        found.append("length-bounded strings (`minLength`/`maxLength`: raw control "
                     "characters slip in)")
    for name, what in (("allOf", "with several subschemas"),
                       ("oneOf", "with several subschemas (enforced as anyOf)")):
        value = node.get(name)
        if isinstance(value, list) and len(value) > 1:
            found.append(f"`{name}` {what}")
    for name in _IGNORED:
        if name in node and node[name] is not None:
            found.append(f"`{name}` (ignored)")
    return found


def _children(node: dict) -> list[Any]:
    out: list[Any] = []
    for name in _SUBSCHEMA_ONE:
        if isinstance(node.get(name), dict):
            out.append(node[name])
    for name in _SUBSCHEMA_LIST:
        if isinstance(node.get(name), list):
            out.extend(node[name])
    for name in (*_SUBSCHEMA_MAP, "dependencies"):
        if isinstance(node.get(name), dict):
            out.extend(node[name].values())
    return out


def xgrammar_unenforced_features(schema: Any) -> list[str]:
    """Descriptions (each naming its keyword in backticks) of every construct in a JSON
    schema that xgrammar would silently not enforce, in schema order, without repeats."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for feature in _node_features(node):
            found.setdefault(feature)
        stack.extend(reversed(_children(node)))
    return list(found)


def xgrammar_unenforced_feature(schema: Any) -> str | None:
    """The first construct xgrammar would silently not enforce, or None."""
    features = xgrammar_unenforced_features(schema)
    return features[0] if features else None
