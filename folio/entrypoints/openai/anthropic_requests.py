"""An Anthropic Messages request -> the chat route's ChatCompletionRequest, so one machinery
(chat template, tool parsers, reasoning parser, forced-tool grammars, sampling parameters and
their limits) serves both APIs.

The conversation maps onto the chat template's messages: `system` becomes a system message,
a user turn's tool_result blocks become "tool" messages (in place, so their order is kept), an
assistant turn's tool_use blocks its `tool_calls` (input passed as the object templates render
with tojson) and its thinking blocks its `reasoning_content` (templates that show past
reasoning read it; the others ignore it). An assistant turn last is a prefill: the reply
continues it (continue_final_message), as Anthropic's does.

Every refusal is an OpenAIError (400) whose message starts with the Anthropic field.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from folio.entrypoints.openai.anthropic_protocol import (CountTokensRequest, MessageParam,
                                                         MessagesRequest, TextBlockParam,
                                                         ThinkingConfigParam, ToolChoiceParam)
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import ChatCompletionRequest

_UNSUPPORTED_BLOCKS = {"image", "document"}


def _refuse_media(block: Any, where: str) -> None:
    if block.type in _UNSUPPORTED_BLOCKS:
        raise OpenAIError(f"{where}: {block.type} blocks are not supported here (images: in "
                          "a user turn, on a vision-language model)", param=where)


def _text_parts(blocks: Sequence[Any]) -> list[dict[str, Any]]:
    # The chat machinery joins text parts with "\n" (folio.engine.chat); an image block
    # becomes the chat API's image_url part (a vision-language model takes it, a text
    # model refuses it by name).
    return [{"type": "text", "text": b.text} if b.type == "text" else _image_part(b)
            for b in blocks]


def _image_part(block: Any) -> dict[str, Any]:
    """An image block's source (base64 with its media_type, or a URL) as an image_url part."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', '')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise OpenAIError("image block source must be {\"type\": \"base64\", \"media_type\": "
                          "..., \"data\": ...} or {\"type\": \"url\", \"url\": ...}",
                          param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_content(content: Any, where: str) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for k, block in enumerate(content):
        _refuse_media(block, f"{where}.content[{k}]")
    return _text_parts(content)


def _user_messages(message: MessageParam, i: int, takes_images: bool) -> list[dict[str, Any]]:
    """One user turn: its text as a user message, each tool_result as a tool message, in
    the order the blocks came."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[TextBlockParam] = []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if block.type != "image" or not takes_images:
            _refuse_media(block, where)
        if block.type in ("text", "image"):
            texts.append(block)
        elif block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": _text_parts(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_content(block.content, where)})
        else:
            raise OpenAIError(f"{where}: a user message cannot hold {block.type} blocks",
                              param=where)
    if texts or not out:
        out.append({"role": "user", "content": _text_parts(texts)})
    return out


def _assistant_message(message: MessageParam, i: int) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[TextBlockParam] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        _refuse_media(block, where)
        if block.type == "text":
            texts.append(block)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type != "redacted_thinking":  # opaque to anyone but Anthropic: dropped
            raise OpenAIError(f"{where}: an assistant message cannot hold {block.type} blocks",
                              param=where)
    out: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) or None}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return out


def chat_messages(request: CountTokensRequest, takes_images: bool = False
                  ) -> list[dict[str, Any]]:
    """The conversation as the chat template's messages; `takes_images`: the model is a
    vision-language one (a user turn's image blocks become image_url parts)."""
    out: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _text_parts(request.system)
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        if message.role == "user":
            out.extend(_user_messages(message, i, takes_images))
        else:
            out.append(_assistant_message(message, i))
    return out


def _chat_tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    tools = []
    for tool in request.tools:
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        tools.append({"type": "function", "function": function})
    return tools


def _chat_tool_choice(choice: ToolChoiceParam | None) -> str | dict[str, Any] | None:
    """auto -> "auto", any -> "required", tool -> the named function, none -> "none": the
    chat route's grammar forces the call for any and tool."""
    if choice is None:
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError('tool_choice.name is required when tool_choice.type is "tool"',
                              param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type


def thinking_on(thinking: ThinkingConfigParam | None) -> bool | None:
    """Whether the request asks for thinking; None: it does not say (the model's default)."""
    if thinking is None:
        return None
    return thinking.type != "disabled"


def _check_thinking(request: CountTokensRequest) -> None:
    thinking = request.thinking
    if thinking is None or thinking.type != "enabled":
        return
    if thinking.budget_tokens is None:
        raise OpenAIError('thinking.budget_tokens is required when thinking.type is "enabled"',
                          param="thinking.budget_tokens")
    max_tokens = getattr(request, "max_tokens", None)
    if max_tokens is not None and thinking.budget_tokens >= max_tokens:
        raise OpenAIError(f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than "
                          f"max_tokens ({max_tokens})", param="thinking.budget_tokens")
    if request.tool_choice is not None and request.tool_choice.type in ("any", "tool"):
        # As Anthropic: a forced call leaves no room to think first.
        raise OpenAIError("thinking may not be enabled when tool_choice forces tool use",
                          param="tool_choice")


def to_chat_request(request: CountTokensRequest, thinking_kwargs: Sequence[str],
                    takes_images: bool = False) -> ChatCompletionRequest:
    """The chat request the machinery runs. `thinking_kwargs`: the chat_template_kwargs that
    switch the served model's thinking on or off (its reasoning format's); `takes_images`:
    the served model is a vision-language one."""
    _check_thinking(request)
    if isinstance(request, MessagesRequest) and isinstance(request.output_config, dict) \
            and request.output_config.get("format") is not None:
        raise OpenAIError("output_config.format (structured output) is not supported on "
                          "/v1/messages; use tools with tool_choice", param="output_config.format")
    messages = chat_messages(request, takes_images)
    last = request.messages[-1]
    prefill = last.role == "assistant"
    if prefill and messages[-1].get("tool_calls"):
        raise OpenAIError(f"messages[{len(request.messages) - 1}]: the last message cannot be "
                          "an assistant tool_use turn; send the tool_result in a user message",
                          param="messages")
    on = thinking_on(request.thinking)
    if on is None and request.tool_choice is not None and request.tool_choice.type in ("any",
                                                                                      "tool"):
        # A forced call comes first, with no thinking before it (Anthropic's rule): the
        # grammar must not wait for a think block to end (the engine's reasoning gate).
        on = False
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "tools": _chat_tools(request),
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "add_generation_prompt": not prefill, "continue_final_message": prefill,
        "chat_template_kwargs": None if on is None else {k: on for k in thinking_kwargs},
    }
    if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                      stream=request.stream, temperature=request.temperature,
                      top_p=request.top_p, top_k=request.top_k)
    return ChatCompletionRequest(**fields)


# The chat machinery's messages name OpenAI's fields; an Anthropic client sent these.
_FIELD_NAMES = ((re.compile(r"^stop( strings)?\b"), "stop_sequences"),
                (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
                (re.compile(r"max_completion_tokens"), "max_tokens"))


def anthropic_field_names(error: OpenAIError) -> OpenAIError:
    """The error with the request fields its message names spelt as Anthropic's."""
    message = error.message
    for pattern, name in _FIELD_NAMES:
        message = pattern.sub(name, message)
    if message != error.message:
        error.message = message
        error.args = (message,)
    return error
