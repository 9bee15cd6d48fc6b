"""Tool-call parsers: turn model output into OpenAI ``tool_calls``.

``get_tool_parser(name)`` returns a parser class; instantiate one per request
(``cls(tools=request.tools)``) since streaming parsers are stateful.
"""
from __future__ import annotations

from .auto import detect_tool_parser, tool_parser_for_template
from .base import (ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                   ToolParser, make_tool_call_id)
from .registry import TOOL_PARSERS, get_tool_parser

__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolCallDelta",
    "ToolParser", "detect_tool_parser", "get_tool_parser", "make_tool_call_id",
    "tool_parser_for_template",
]
