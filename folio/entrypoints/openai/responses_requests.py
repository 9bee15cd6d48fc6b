"""A Responses request (and the stored conversation it continues) -> the chat route's
ChatCompletionRequest, so one machinery (chat template, tool parsers, reasoning parser,
forced-tool and json_schema grammars, sampling parameters and their limits, LoRA) serves both
APIs; and the fields the response object echoes.

The conversation maps onto the chat template's messages: `instructions` becomes the first
system message, message items keep their role (developer is the template's system), a run of
reasoning / assistant message / function_call items becomes one assistant turn (reasoning as
its `reasoning_content`, calls as its `tool_calls`), and each function_call_output a "tool"
message. The reply always starts a new assistant turn.

Every refusal is an OpenAIError (400) whose message starts with the Responses field.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import pydantic

from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.responses_protocol import (FUNCTION_CALL, FUNCTION_CALL_OUTPUT,
                                                         FUNCTION_TOOL, MESSAGE, REASONING,
                                                         ContentPart, FunctionCallItem,
                                                         FunctionTool, ReasoningItem,
                                                         ResponsesRequest)

# reasoning.effort that turns thinking off; any other effort turns it on.
_NO_REASONING = "none"
# The chat_template_kwargs key templates with effort levels read (gpt-oss's).
_EFFORT_KWARG = "reasoning_effort"


def _text(parts: str | Sequence[ContentPart], where: str) -> str:
    """A content's text; media parts are refused (the chat machinery joins parts with
    "\\n", so the parts are joined the same way)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for k, part in enumerate(parts):
        if part.type in ("input_text", "output_text"):
            texts.append(part.text)
        elif part.type == "refusal":
            texts.append(part.refusal)
        else:
            raise OpenAIError(f"{where}.content[{k}]: {part.type} parts are not supported on "
                              "/v1/responses (images: /v1/chat/completions or /v1/messages, "
                              "on a vision-language model)", param=f"{where}.content[{k}]")
    return "\n".join(texts)


def _reasoning_text(item: ReasoningItem) -> str:
    parts = item.content or item.summary
    return "\n".join(part.text for part in parts)


class _Conversation:
    """Chat messages built item by item; an assistant turn stays open while its items come."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None

    def close_turn(self) -> None:
        if self._turn is not None:
            self.messages.append(self._turn)
            self._turn = None

    def _open_turn(self) -> dict[str, Any]:
        if self._turn is None:
            self._turn = {"role": "assistant", "content": None}
        return self._turn

    def assistant_text(self, text: str) -> None:
        turn = self._turn
        if turn is not None and (turn["content"] is not None or turn.get("tool_calls")):
            self.close_turn()  # a second message: a new turn
        self._open_turn()["content"] = text

    def reasoning(self, text: str) -> None:
        if self._turn is not None:
            self.close_turn()  # reasoning starts a turn
        self._open_turn()["reasoning_content"] = text

    def call(self, item: FunctionCallItem) -> None:
        self._open_turn().setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function",
             "function": {"name": item.name, "arguments": item.arguments}})

    def message(self, message: dict[str, Any]) -> None:
        self.close_turn()
        self.messages.append(message)


def chat_messages(instructions: str | None, items: Sequence[Any], first_input: int
                  ) -> list[dict[str, Any]]:
    """The conversation as the chat template's messages. `items`: the stored conversation's
    items, then the request's own from index `first_input` (errors name `input[i]` for
    those)."""
    conversation = _Conversation()
    if instructions:
        conversation.message({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i - first_input}]" if i >= first_input else "previous_response_id"
        if item.type == MESSAGE:
            text = _text(item.content, where)
            if item.role == "assistant":
                conversation.assistant_text(text)
            else:
                conversation.message({"role": item.role, "content": text})
        elif item.type == FUNCTION_CALL:
            conversation.call(item)
        elif item.type == FUNCTION_CALL_OUTPUT:
            conversation.message({"role": "tool", "tool_call_id": item.call_id,
                                  "content": _text(item.output, where)})
        elif item.type == REASONING:
            conversation.reasoning(_reasoning_text(item))
        else:
            raise OpenAIError(f"{where}: {item.type} items are not supported; this server "
                              "takes message, function_call, function_call_output and "
                              "reasoning items", param=f"{where}.type")
    conversation.close_turn()
    if not conversation.messages:
        raise OpenAIError("input must hold at least one item", param="input")
    return conversation.messages


def response_tools(request: ResponsesRequest, max_tools: int) -> list[dict[str, Any]]:
    """The request's function tools in the Responses shape (as the response echoes them);
    built-in tools are refused, all named in one message."""
    tools = request.tools or []
    if len(tools) > max_tools:  # before each is checked: that is work per tool
        raise OpenAIError(f"tools has {len(tools)} entries; at most {max_tools} are allowed "
                          "(--max-tools)", param="tools")
    builtin = [(i, tool.get("type")) for i, tool in enumerate(tools)
               if tool.get("type") != FUNCTION_TOOL]
    if builtin:
        names = ", ".join(sorted({str(kind) for _, kind in builtin}))
        raise OpenAIError(f"tools: built-in tools are not supported by this server ({names}); "
                          "only function tools ({\"type\": \"function\", \"name\": ..., "
                          "\"parameters\": {...}}) run here", param=f"tools[{builtin[0][0]}].type")
    out = []
    for i, tool in enumerate(tools):
        try:
            function = FunctionTool.model_validate(tool)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join([f"tools[{i}]", *map(str, first["loc"])])
            raise OpenAIError(f"{where}: {first['msg']}", param=where) from None
        out.append(function.model_dump())
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["parameters"]
                                    or {"type": "object", "properties": {}}}
        if tool["description"] is not None:
            function["description"] = tool["description"]
        if tool["strict"] is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """auto / none / required as they are; {"type": "function", "name": N} -> the chat
    route's named function (forced by a grammar). allowed_tools and hosted tools' choices
    are refused."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == FUNCTION_TOOL:
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError('tool_choice.name is required when tool_choice.type is "function"',
                              param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise OpenAIError(f"tool_choice of type {kind!r} is not supported; use \"auto\", \"none\", "
                      "\"required\" or {\"type\": \"function\", \"name\": ...}",
                      param="tool_choice.type")


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.json_schema}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


def _template_kwargs(request: ResponsesRequest, thinking_kwargs: Sequence[str]
                     ) -> dict[str, Any] | None:
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return None  # the template's default
    on = effort != _NO_REASONING
    kwargs: dict[str, Any] = {k: on for k in thinking_kwargs}
    if on:
        kwargs[_EFFORT_KWARG] = effort
    return kwargs


def check_request(request: ResponsesRequest) -> None:
    """What the Responses API asks of a request before anything runs."""
    if request.background and not request.store:
        raise OpenAIError("background mode requires store to be true", param="background")
    if request.truncation == "auto":
        raise OpenAIError('truncation "auto" is not supported: this server never drops '
                          "conversation items; a conversation past the context is a 400",
                          param="truncation")
    if request.conversation is not None:
        raise OpenAIError("conversation is not supported; continue a conversation with "
                          "previous_response_id", param="conversation")
    if request.prompt is not None:
        raise OpenAIError("prompt (stored prompt templates) is not supported",
                          param="prompt")
    for i, value in enumerate(request.include or ()):
        if value == "message.output_text.logprobs":
            raise OpenAIError("include: message.output_text.logprobs is not supported",
                              param=f"include[{i}]")


def to_chat_request(request: ResponsesRequest, items: Sequence[Any], first_input: int,
                    tools: list[dict[str, Any]], thinking_kwargs: Sequence[str]
                    ) -> ChatCompletionRequest:
    """The chat request the machinery runs. `items`: the whole conversation (the stored
    one's items, then the request's own from `first_input`); `tools`: response_tools(request);
    `thinking_kwargs`: the chat_template_kwargs that switch the served model's thinking."""
    return ChatCompletionRequest(
        model=request.model, messages=chat_messages(request.instructions, items, first_input),
        tools=_chat_tools(tools), tool_choice=_chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        chat_template_kwargs=_template_kwargs(request, thinking_kwargs),
        max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
        top_p=request.top_p, user=request.user,
        # Deltas for a background run too: a poll shows the output so far.
        stream=request.stream or request.background)


def echo_fields(request: ResponsesRequest, tools: list[dict[str, Any]],
                temperature: float, top_p: float) -> dict[str, Any]:
    """The request's fields the response object repeats (with OpenAI's defaults);
    temperature and top_p are the ones the request runs with."""
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
    text.setdefault("format", {"type": "text"})
    reasoning = request.reasoning
    return {
        "background": request.background, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls, "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "store": request.store, "temperature": temperature, "text": text,
        "tool_choice": request.tool_choice or "auto", "tools": tools, "top_p": top_p,
        "truncation": request.truncation or "disabled", "user": request.user,
    }


def _stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the JSON object the store keeps and /input_items lists: OpenAI's
    names, a message's text as a list of parts."""
    content = item.get("content")
    if item["type"] == MESSAGE and isinstance(content, str):
        part = ({"type": "output_text", "text": content, "annotations": []}
                if item["role"] == "assistant" else {"type": "input_text", "text": content})
        item = {**item, "content": [part]}
    return item


def request_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as item objects (a string is one user message)."""
    if isinstance(request.input, str):
        return [_stored_item({"type": MESSAGE, "role": "user", "content": request.input})]
    return [_stored_item(item.model_dump(mode="json", by_alias=True, exclude_none=True))
            for item in request.input]


# The chat machinery's messages name the chat request's fields; a Responses client sent these.
_FIELD_NAMES = ((re.compile(r"max_completion_tokens"), "max_output_tokens"),
                (re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
                (re.compile(r"response_format(\.json_schema)?"), "text.format"),
                (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].parameters"),
                (re.compile(r"\bmessages\b"), "input"))


def responses_field_names(error: OpenAIError) -> OpenAIError:
    """The error with the request fields its message and param name spelt as the Responses
    API's."""
    message, param = error.message, error.param
    for pattern, name in _FIELD_NAMES:
        message = pattern.sub(name, message)
        if param is not None:
            param = pattern.sub(name, param)
    error.message, error.param, error.args = message, param, (message,)
    return error
