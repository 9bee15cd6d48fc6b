"""--reasoning-parser on /v1/chat/completions: thinking text goes to `reasoning` and
`reasoning_content`, the answer to `content`, streaming and not; enable_thinking=False keeps
everything as content."""
from __future__ import annotations

from typing import Any

from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from test_openai_serving import MESSAGES, MODEL, FakeEngine, _resolve, events, run, tokenizer  # noqa: F401

THOUGHT = "<think>The user wants a greeting. Keep it short.</think>Hello there!"


def _chat(engine: FakeEngine, parser: str | None, **fields: Any) -> Any:
    fields.setdefault("model", MODEL)
    fields.setdefault("messages", MESSAGES)
    handler = OpenAIServingChat(engine, [MODEL], reasoning_parser=parser)
    request = ChatCompletionRequest.model_validate(fields)
    return run(_resolve(handler.create_chat_completion(request, request_id="r")))


def test_non_streaming_splits_reasoning(tokenizer):
    engine = FakeEngine(tokenizer, texts=(THOUGHT,))
    body = _chat(engine, "qwen3").model_dump()
    message = body["choices"][0]["message"]
    assert message["content"] == "Hello there!"
    assert message["reasoning_content"] == message["reasoning"] == \
        "The user wants a greeting. Keep it short."


def test_without_parser_text_is_untouched(tokenizer):
    engine = FakeEngine(tokenizer, texts=(THOUGHT,))
    message = _chat(engine, None).model_dump()["choices"][0]["message"]
    assert message["content"] == THOUGHT
    assert "reasoning" not in message and "reasoning_content" not in message


def test_enable_thinking_false_keeps_content(tokenizer):
    engine = FakeEngine(tokenizer, texts=("Hello there!",))
    message = _chat(engine, "qwen3", chat_template_kwargs={"enable_thinking": False}
                    ).model_dump()["choices"][0]["message"]
    assert message["content"] == "Hello there!" and "reasoning" not in message


def test_streaming_splits_reasoning(tokenizer):
    engine = FakeEngine(tokenizer, texts=(THOUGHT,))
    chunks = [e for e in events(_chat(engine, "deepseek_r1", stream=True)) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    reasoning_alias = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == reasoning_alias == "The user wants a greeting. Keep it short."
    assert content == "Hello there!"
    assert all("<think>" not in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_deepseek_v3_thinks_only_when_asked(tokenizer):
    """deepseek_v3 (DeepSeek-V3.1): thinking is off unless chat_template_kwargs set `thinking`."""
    text = "Short plan.</think>Hello there!"  # V3.1's template put <think> in the prompt
    engine = FakeEngine(tokenizer, texts=(text,))
    message = _chat(engine, "deepseek_v3").model_dump()["choices"][0]["message"]
    assert message["content"] == text and "reasoning" not in message
    engine = FakeEngine(tokenizer, texts=(text,))
    message = _chat(engine, "deepseek_v3", chat_template_kwargs={"thinking": True}
                    ).model_dump()["choices"][0]["message"]
    assert message["reasoning"] == "Short plan." and message["content"] == "Hello there!"
