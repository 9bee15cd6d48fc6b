"""Tool-call parsers: turn model output into OpenAI ``tool_calls``.

``get_tool_parser(name)`` returns a parser class; instantiate one per request
(``cls(tools=request.tools)``) since streaming parsers are stateful.
"""
from __future__ import annotations

from .auto import detect_tool_parser, tool_parser_for_template
from .base import (ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                   ToolParser, make_tool_call_id)
from .deepseek_v3 import DeepSeekV3ToolParser
from .granite import GraniteToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "granite": GraniteToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; "
                       f"available: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolCallDelta",
    "ToolParser", "detect_tool_parser", "get_tool_parser", "make_tool_call_id",
    "tool_parser_for_template",
]
