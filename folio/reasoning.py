"""The reasoning formats: how each `--reasoning-parser` marks a model's thinking.

Pure data, shared by two layers: the OpenAI entrypoints split output text into (reasoning,
content) with it (`folio/entrypoints/openai/reasoning_parsers.py`), and the engine core keeps a
grammar inactive until the reasoning's end tag (`folio/engine/grammar_manager.py`). It sits
below both, so the engine never imports the entrypoints.

* ``deepseek_r1``: ``<think>…</think>``; the opening tag may be missing because the chat
  template already put it in the prompt, so output starts inside the reasoning.
* ``qwen3``: ``<think>…</think>``, reasoning only after an explicit opening tag.
* ``mistral``: like qwen3 with ``[THINK]…[/THINK]`` (Magistral).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    # True when the prompt may already hold the opening tag, so output starts inside the
    # reasoning block.
    starts_in_reasoning: bool = False


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    fmt.name: fmt for fmt in (
        ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
        ReasoningFormat("qwen3"),
        ReasoningFormat("mistral", start_tag="[THINK]", end_tag="[/THINK]"),
    )
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; "
                       f"available: {', '.join(sorted(REASONING_FORMATS))}") from None
