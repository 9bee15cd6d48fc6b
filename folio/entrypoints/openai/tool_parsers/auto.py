"""Pick a tool parser from a chat template by the call markers it renders.

Order matters: more specific formats first (Qwen3-Coder templates also
contain ``<tool_call>``; pythonic Llama templates may mention python tags).
"""
from __future__ import annotations

from .base import ToolParser
from .registry import get_tool_parser

# (parser name, markers that must all appear in the template)
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_xml", ("<tool_call>", "<function=")),
    ("deepseek_v3", ("tool▁calls▁begin",)),
    ("granite", ("<|tool_call|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("<|python_start|>",)),
    ("pythonic", ("[func_name1(",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """Name of the parser whose markers the template uses, or None."""
    if not chat_template:
        return None
    for name, markers in _RULES:
        if all(m in chat_template for m in markers):
            return name
    return None


def tool_parser_for_template(chat_template: str | None) -> type[ToolParser] | None:
    name = detect_tool_parser(chat_template)
    return get_tool_parser(name) if name else None
