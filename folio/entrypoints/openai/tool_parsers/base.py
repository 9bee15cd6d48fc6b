"""Shared types and the streaming machinery for tool-call parsers.

Every format module implements one method, ``_parse(text, final)``, which turns
the model output seen so far into a list of segments (plain text and calls).
Streaming re-parses the whole buffer on each delta and emits only the *growth*
since the last delta. That keeps streaming and non-streaming on one code path,
so they cannot disagree on well-formed output, but in one respect: the full
reply re-serializes each call's arguments (compact JSON), where the stream sends
the model's own text of them (the same object, its whitespace as written).

Contract for ``_parse(text, final=False)`` (the streaming view): everything it
reports must be stable, i.e. a prefix of what any longer text would report:
  * the concatenated ``Text`` segments may only grow at the end, so text that
    could still turn out to be (the start of) a marker must be held back;
  * a ``PartialCall.name`` is reported only once it is complete;
  * ``PartialCall.arguments`` may only grow by appending.
With ``final=True`` it returns ``None`` for malformed output.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """OpenAI-style id: ``call_`` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object serialized as a string (the OpenAI shape)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # text outside the calls


@dataclass
class ToolCallDelta:
    """One OpenAI streaming tool-call delta: id+name first, then argument fragments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---------------------------------------------------------------- segments


@dataclass
class Text:
    text: str


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str = ""  # raw JSON text of the arguments object seen so far
    complete: bool = False


Segment = Text | PartialCall


def partial_suffix_len(text: str, markers: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker.

    That much text must be held back while streaming: it may become a marker.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def split_at_marker(text: str, pos: int, marker: str, final: bool,
                    hold: tuple[str, ...] = ()) -> tuple[str, int | None]:
    """Split ``text[pos:]`` at the first ``marker``.

    Returns (text before the marker, index just after it). When the marker is
    absent, the index is None and, while streaming, a trailing partial marker
    (or partial ``hold`` marker) is cut from the returned text.
    """
    j = text.find(marker, pos)
    if j >= 0:
        return text[pos:j], j + len(marker)
    tail = text[pos:]
    if not final:
        tail = tail[:len(tail) - partial_suffix_len(tail, (marker, *hold))]
    return tail, None


def expect(text: str, k: int, token: str, final: bool) -> str:
    """Is ``token`` at ``text[k:]``? 'ok', 'partial' (could still be, streaming only),
    'eof' (text ended there, final only) or 'no'."""
    if text.startswith(token, k):
        return "ok"
    rest = text[k:]
    if not final and token.startswith(rest):
        return "partial"
    if final and not rest:
        return "eof"
    return "no"


def build_args(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """Serialize completed (key, value) pairs as a growing JSON object text.

    Uses json.dumps' default separators so that, once closed, the text is
    exactly ``json.dumps(dict(pairs))`` for unique keys.
    """
    body = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in pairs)
    return "{" + body + ("}" if closed else "")


# ---------------------------------------------------------------- parser base


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class ToolParser:
    """Base class; subclasses set ``name`` and implement ``_parse``."""

    name: ClassVar[str] = ""

    def __init__(self, tools: list[dict] | None = None, *,
                 id_factory: Callable[[], str] | None = None) -> None:
        self.tools = tools or []
        self._new_id = id_factory or make_tool_call_id
        self._buffer = ""
        self._sent_content = ""
        self._sent_calls: list[_SentCall] = []
        self._finished = False

    # -- format hook
    def _parse(self, text: str, final: bool) -> list[Segment] | None:
        raise NotImplementedError

    # -- helpers for subclasses
    def tool_schema(self, function_name: str) -> dict[str, Any]:
        """The JSON schema of ``function_name``'s parameters (empty if unknown)."""
        for tool in self.tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and fn.get("name") == function_name:
                params = fn.get("parameters")
                return params if isinstance(params, dict) else {}
        return {}

    # -- non-streaming
    def _final_segments(self, text: str) -> list[Segment] | None:
        """Parse complete output; None when malformed. Never raises."""
        try:
            segments = self._parse(text, final=True)
        except Exception:  # a parser bug must degrade to plain content
            return None
        if segments is None:
            return None
        calls = [s for s in segments if isinstance(s, PartialCall)]
        for call in calls:
            if not call.complete or not call.name:
                return None
            try:
                args = json.loads(call.arguments or "{}")
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
        return segments

    def extract(self, text: str) -> ExtractedToolCalls:
        segments = self._final_segments(text)
        calls = [s for s in segments or () if isinstance(s, PartialCall)]
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
        tool_calls = [
            ToolCall(id=self._new_id(), name=c.name or "",
                     arguments=json.dumps(json.loads(c.arguments or "{}"),
                                          ensure_ascii=False))
            for c in calls
        ]
        content = "".join(s.text for s in segments or () if isinstance(s, Text))
        return ExtractedToolCalls(tools_called=True, tool_calls=tool_calls,
                                  content=content if content.strip() else None)

    # -- streaming
    def extract_streaming(self, delta_text: str) -> StreamDelta | None:
        if self._finished:
            raise RuntimeError("extract_streaming() called after finish()")
        if not delta_text:
            return None
        self._buffer += delta_text
        try:
            segments = self._parse(self._buffer, final=False)
        except Exception:
            return None  # hold; finish() decides
        return self._emit(segments or [])

    def finish(self) -> StreamDelta | None:
        if self._finished:
            return None
        self._finished = True
        segments = self._final_segments(self._buffer)
        if segments is None or not any(isinstance(s, PartialCall) for s in segments):
            # Not tool calls after all: everything is content. Already-emitted
            # calls cannot be taken back (see module docstring).
            segments = [Text(self._buffer)]
            return self._emit(segments, blank_is_content=not self._sent_calls)
        return self._emit(segments)

    def stream_pieces(self, content: str | None, final: bool) -> list[StreamDelta]:
        """A streamed content delta's pieces to send: what it adds, and with `final` what
        finish() still had (the stream ended)."""
        pieces = [self.extract_streaming(content)] if content else []
        if final:
            pieces.append(self.finish())
        return [piece for piece in pieces if piece is not None]

    def _emit(self, segments: list[Segment], blank_is_content: bool = False
              ) -> StreamDelta | None:
        """Diff ``segments`` against what was already sent. Content that is only whitespace
        so far is held back: beside tool calls the whole reply drops it (``extract``: content
        None; a newline between two calls had been streamed as content, and became a message
        item or text block of its own in the Responses and Messages streams). A reply that
        ends without calls sends it (``blank_is_content``)."""
        out = StreamDelta()
        content = "".join(s.text for s in segments if isinstance(s, Text))
        if (content.strip() or blank_is_content) and len(content) > len(self._sent_content) \
                and content.startswith(self._sent_content):
            out.content = content[len(self._sent_content):]
            self._sent_content = content
        calls = [s for s in segments if isinstance(s, PartialCall)]
        for i, call in enumerate(calls):
            if not call.name:
                break  # later calls must wait: indices are emitted in order
            if i == len(self._sent_calls):
                sent = _SentCall(id=self._new_id(), name=call.name)
                self._sent_calls.append(sent)
                out.tool_calls.append(ToolCallDelta(index=i, id=sent.id, name=sent.name))
            sent = self._sent_calls[i]
            if sent.name != call.name:
                break  # inconsistent re-parse (malformed output); stop emitting
            if len(call.arguments) > len(sent.arguments) and \
                    call.arguments.startswith(sent.arguments):
                out.tool_calls.append(ToolCallDelta(
                    index=i, arguments=call.arguments[len(sent.arguments):]))
                sent.arguments = call.arguments
        if out.content is None and not out.tool_calls:
            return None
        return out
