"""The reasoning formats: how each `--reasoning-parser` marks a model's thinking.

Pure data, shared by two layers: the OpenAI entrypoints split output text into (reasoning,
content) with it (`folio/entrypoints/openai/reasoning_parsers.py`), and the engine core keeps a
grammar inactive until the reasoning's end tag (`folio/engine/grammar_manager.py`). It sits
below both, so the engine never imports the entrypoints.

* ``deepseek_r1``: ``<think>…</think>``; the opening tag may be missing because the chat
  template already put it in the prompt, so output starts inside the reasoning.
* ``qwen3``: ``<think>…</think>``, reasoning only after an explicit opening tag.
* ``mistral``: like qwen3 with ``[THINK]…[/THINK]`` (Magistral).
* ``deepseek_v3``: DeepSeek-V3.1's hybrid modes. Thinking is off unless the request's
  ``chat_template_kwargs`` set ``thinking`` (or ``enable_thinking``); then it is read like
  deepseek_r1 (V3.1's template ends the prompt with ``<think>``, or with ``</think>`` when not
  thinking). Off, all output is content. The engine's gate counts reasoning only when the
  prompt leaves a think block open, so templates without think tags (V3, V3-0324) are never
  gated.
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
    # The chat_template_kwargs that switch thinking on or off (any one true turns it on),
    # and whether it is on when the request sets none of them.
    thinking_kwargs: tuple[str, ...] = ("enable_thinking",)
    thinking_default: bool = True
    # True when there is reasoning only if the prompt leaves a think block open (its last
    # start tag after its last end tag); False: until an end tag, unless the prompt closed
    # the block it opened last.
    prompt_opens: bool = False

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Is thinking on for a request with these chat_template_kwargs?"""
        kwargs = chat_template_kwargs or {}
        given = [k for k in self.thinking_kwargs if k in kwargs]
        if not given:
            return self.thinking_default
        return any(bool(kwargs[k]) for k in given)


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    fmt.name: fmt for fmt in (
        ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
        ReasoningFormat("qwen3"),
        ReasoningFormat("mistral", start_tag="[THINK]", end_tag="[/THINK]"),
        ReasoningFormat("deepseek_v3", starts_in_reasoning=True,
                        thinking_kwargs=("thinking", "enable_thinking"), thinking_default=False,
                        prompt_opens=True),
    )
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; "
                       f"available: {', '.join(sorted(REASONING_FORMATS))}") from None
