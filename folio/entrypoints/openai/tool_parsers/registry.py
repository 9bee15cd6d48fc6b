"""The tool-call parsers by their `--tool-call-parser` names."""
from __future__ import annotations

from .base import ToolParser
from .deepseek_v3 import DeepSeekV3ToolParser
from .granite import GraniteToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .phi4_mini import Phi4MiniJsonToolParser
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
    "phi4_mini_json": Phi4MiniJsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; "
                       f"available: {', '.join(sorted(TOOL_PARSERS))}") from None
