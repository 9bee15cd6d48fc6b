"""Pick a tool parser from a chat template by the call markers it renders.

Order matters: more specific formats first (Qwen3-Coder templates also
contain ``<tool_call>``; pythonic Llama templates may mention python tags).
``functools`` is an ordinary word, so Phi-4-mini's rules come last.

Templates with no call syntax detect nothing: Gemma 3's and Phi-3's official
templates, Mixtral-8x7B's, Qwen2-MoE's. Gemma 3 is served with ``pythonic``
through vLLM's example template (tool_chat_template_gemma3_pythonic.jinja),
which its ``[func_name1(`` example detects.
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
    # Phi-4-mini: vLLM's example template asks for functools[...]; the official one
    # declares tools between <|tool|> and <|/tool|> in the system turn.
    ("phi4_mini_json", ("functools[",)),
    ("phi4_mini_json", ("<|tool|>", "<|/tool|>")),
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
