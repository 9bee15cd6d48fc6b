"""Reasoning parsers: split model output into (reasoning, content).

* ``deepseek_r1``: ``<think>…</think>``; the opening tag may be missing because
  the chat template already put it in the prompt, so output without tags is
  (unterminated) reasoning.
* ``qwen3``: ``<think>…</think>`` where reasoning only starts with an explicit
  opening tag; no tags (e.g. thinking disabled) means all content. Models whose
  template pre-fills ``<think>`` (Qwen3 *-Thinking-2507) should use deepseek_r1.
* ``mistral``: like qwen3 with ``[THINK]…[/THINK]`` (Magistral).
* ``deepseek_v3``: DeepSeek-V3.1's hybrid modes; thinking is off unless
  ``chat_template_kwargs`` set ``thinking`` (or ``enable_thinking``), and then it
  is read like deepseek_r1. Off, everything is content (as vLLM's deepseek_v3).

An unterminated think block is all reasoning. With ``enable_thinking=False``
everything is content. Empty parts are reported as None.
"""
from __future__ import annotations

from typing import ClassVar

from folio.reasoning import REASONING_FORMATS


def _partial_suffix_len(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _nonempty(s: str) -> str | None:
    return s or None


class ReasoningParser:
    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # True when the prompt may already hold the opening tag, so output starts
    # inside the reasoning block.
    starts_in_reasoning: ClassVar[bool] = False

    @classmethod
    def for_request(cls, chat_template_kwargs: dict | None) -> "ReasoningParser":
        """A parser for one request: thinking on or off per its chat_template_kwargs
        (``enable_thinking``, default on; deepseek_v3: ``thinking``, default off)."""
        return cls(enable_thinking=REASONING_FORMATS[cls.name].thinking(chat_template_kwargs))

    def __init__(self, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking
        # "start": deciding whether a think block opens; then "reasoning" / "content"
        self._state = "start" if enable_thinking else "content"
        self._held = ""
        self._finished = False

    # -- non-streaming
    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not self.enable_thinking:
            return None, _nonempty(text)
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            body = stripped[len(self.start_tag):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, _nonempty(text)
        end = body.find(self.end_tag)
        if end < 0:
            return _nonempty(body), None
        return _nonempty(body[:end]), _nonempty(body[end + len(self.end_tag):])

    # -- streaming
    def extract_streaming(self, delta_text: str) -> tuple[str | None, str | None]:
        if self._finished:
            raise RuntimeError("extract_streaming() called after finish()")
        self._held += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        if self._finished:
            return None, None
        self._finished = True
        return self._advance(final=True)

    def split_delta(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """One streamed delta as (reasoning, content); with `final`, what the parser still
        held is added (the stream ended)."""
        reasoning, content = self.extract_streaming(text) if text else (None, None)
        if final:
            tail_reasoning, tail_content = self.finish()
            reasoning = (reasoning or "") + (tail_reasoning or "") or None
            content = (content or "") + (tail_content or "") or None
        return reasoning, content

    def _advance(self, final: bool) -> tuple[str | None, str | None]:
        reasoning = content = ""
        if self._state == "start":
            stripped = self._held.lstrip()
            if stripped.startswith(self.start_tag):
                self._state, self._held = "reasoning", stripped[len(self.start_tag):]
            elif self.start_tag.startswith(stripped) and not final:
                return None, None  # may still become the opening tag
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._held.find(self.end_tag)
            if end >= 0:
                reasoning = self._held[:end]
                self._held = self._held[end + len(self.end_tag):]
                self._state = "content"
            else:
                keep = 0 if final else _partial_suffix_len(self._held, self.end_tag)
                reasoning = self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
        if self._state == "content":
            content, self._held = self._held, ""
        return _nonempty(reasoning), _nonempty(content)


def _tags(name: str) -> tuple[str, str, str, bool]:
    fmt = REASONING_FORMATS[name]
    return fmt.name, fmt.start_tag, fmt.end_tag, fmt.starts_in_reasoning


# The tags live in folio/reasoning.py, which the engine core's reasoning gate also reads.
class DeepSeekR1ReasoningParser(ReasoningParser):
    name, start_tag, end_tag, starts_in_reasoning = _tags("deepseek_r1")


class Qwen3ReasoningParser(ReasoningParser):
    name, start_tag, end_tag, starts_in_reasoning = _tags("qwen3")


class MistralReasoningParser(ReasoningParser):
    name, start_tag, end_tag, starts_in_reasoning = _tags("mistral")


class DeepSeekV3ReasoningParser(ReasoningParser):
    """deepseek_r1's reading when thinking is on; see ``for_request`` for the switch."""
    name, start_tag, end_tag, starts_in_reasoning = _tags("deepseek_v3")

    def __init__(self, enable_thinking: bool = False) -> None:
        super().__init__(enable_thinking)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, MistralReasoningParser,
                DeepSeekV3ReasoningParser)
}


def split_reasoning(parser: ReasoningParser | None, text: str,
                    final: bool) -> tuple[str | None, str | None]:
    """A streamed delta as (reasoning, content): all content without a parser."""
    if parser is None:
        return None, text or None
    return parser.split_delta(text, final)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; "
                       f"available: {', '.join(sorted(REASONING_PARSERS))}") from None
