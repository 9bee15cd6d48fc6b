"""Reasoning parsers: non-streaming splits and streaming agreement.

Streaming is checked by feeding each sample whole, split at every character
boundary and one character at a time; the reassembled (reasoning, content)
must equal ``extract()`` exactly, so no partial tag can leak.
"""
from __future__ import annotations

import pytest

from folio.entrypoints.openai.reasoning_parsers import (REASONING_PARSERS,
                                                        ReasoningParser,
                                                        get_reasoning_parser)


def _splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for r, c in [parser.extract_streaming(p) for p in pieces] + [parser.finish()]:
        assert r != "" and c != "", "empty parts are reported as None"
        reasoning += r or ""
        content += c or ""
    return reasoning or None, content or None


def check(name: str, text: str, expected: tuple[str | None, str | None], enable_thinking=True):
    cls = get_reasoning_parser(name)
    assert cls(enable_thinking).extract(text) == expected
    for pieces in _splits(text):
        assert _stream(cls(enable_thinking), pieces) == expected, pieces


@pytest.mark.parametrize("text,expected", [
    ("<think>Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    ("Let me think.\n</think>\n\nThe answer is 4.", ("Let me think.\n", "\n\nThe answer is 4.")),
    ("\n<think>\nhmm < / think > </thin</think>ok", ("\nhmm < / think > </thin", "ok")),
    ("still thinking… <thi", ("still thinking… <thi", None)),  # unterminated
    ("<think>unterminated", ("unterminated", None)),
    ("no tags at all", ("no tags at all", None)),  # the template opened <think>
    ("<think></think>", (None, None)),
    ("</think>only content", (None, "only content")),
    ("推理</think>答案 🙂", ("推理", "答案 🙂")),
    ("", (None, None)),
])
def test_deepseek_r1(text, expected):
    check("deepseek_r1", text, expected)


@pytest.mark.parametrize("text,expected", [
    ("<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    ("  <think>a</think>b</think>c", ("a", "b</think>c")),
    ("<think>unterminated </th", ("unterminated </th", None)),
    ("no tags → all content", (None, "no tags → all content")),
    ("<thinking is not a tag", (None, "<thinking is not a tag")),
    ("answer first </think> then", (None, "answer first </think> then")),
    ("<thi", (None, "<thi")),
    ("  ", (None, "  ")),
])
def test_qwen3(text, expected):
    check("qwen3", text, expected)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "mistral"])
def test_thinking_disabled_is_all_content(name):
    check(name, "<think>x</think>y", (None, "<think>x</think>y"), enable_thinking=False)
    check(name, "plain", (None, "plain"), enable_thinking=False)


@pytest.mark.parametrize("text,expected", [
    ("[THINK]Compute 2+2.[/THINK]4", ("Compute 2+2.", "4")),
    ("[THINK]unterminated [/THI", ("unterminated [/THI", None)),
    ("Just [an] answer", (None, "Just [an] answer")),
    ("[THINK][/THINK]", (None, None)),
])
def test_mistral(text, expected):
    check("mistral", text, expected)


V31_THOUGHT = "The user greets me.</think>Hello! 你好"


@pytest.mark.parametrize("kwargs,expected", [
    (None, (None, V31_THOUGHT)),  # thinking is off by default: all content
    ({}, (None, V31_THOUGHT)),
    ({"thinking": False}, (None, V31_THOUGHT)),
    ({"enable_thinking": False}, (None, V31_THOUGHT)),
    ({"thinking": True}, ("The user greets me.", "Hello! 你好")),  # <think> was in the prompt
    ({"enable_thinking": True}, ("The user greets me.", "Hello! 你好")),
    ({"thinking": False, "enable_thinking": True}, ("The user greets me.", "Hello! 你好")),
])
def test_deepseek_v3_thinking_switch(kwargs, expected):
    cls = get_reasoning_parser("deepseek_v3")
    parser = cls.for_request(kwargs)
    assert parser.enable_thinking == (expected[0] is not None)
    assert parser.extract(V31_THOUGHT) == expected
    check("deepseek_v3", V31_THOUGHT, expected, enable_thinking=parser.enable_thinking)


@pytest.mark.parametrize("text,expected", [
    ("<think>plan</think>answer", ("plan", "answer")),
    ("unterminated thought", ("unterminated thought", None)),
    ("</think>", (None, None)),
])
def test_deepseek_v3_thinking(text, expected):
    check("deepseek_v3", text, expected, enable_thinking=True)


def test_for_request_reads_enable_thinking():
    for name in ("qwen3", "deepseek_r1", "mistral"):
        cls = get_reasoning_parser(name)
        assert cls.for_request(None).enable_thinking
        assert cls.for_request({"thinking": False}).enable_thinking  # not their switch
        assert not cls.for_request({"enable_thinking": False}).enable_thinking


def test_no_reasoning_parser_for_gemma_or_phi():
    """vLLM has none for Gemma 3 or Phi; folio invents none (see docs/architecture.md)."""
    assert not {"gemma3", "phi4", "phi4_mini", "phi3"} & set(REASONING_PARSERS)


def test_registry():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3", "mistral", "deepseek_v3"}
    with pytest.raises(KeyError):
        get_reasoning_parser("nope")


def test_parsers_use_the_shared_formats():
    """The engine core's reasoning gate reads the tags from folio.reasoning; the parsers must
    split on the same ones, and every format (a valid --reasoning-parser) has a parser."""
    from folio.config import StructuredOutputsConfig
    from folio.reasoning import REASONING_FORMATS
    assert set(REASONING_PARSERS) == set(REASONING_FORMATS)
    for name, fmt in REASONING_FORMATS.items():
        cls = get_reasoning_parser(name)
        assert (cls.name, cls.start_tag, cls.end_tag, cls.starts_in_reasoning) == \
            (fmt.name, fmt.start_tag, fmt.end_tag, fmt.starts_in_reasoning)
        StructuredOutputsConfig(reasoning_parser=name)
    assert get_reasoning_parser("mistral").end_tag == "[/THINK]"
    assert get_reasoning_parser("deepseek_r1").starts_in_reasoning
