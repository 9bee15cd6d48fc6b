"""Pydantic models of Anthropic's Messages API requests (POST /v1/messages and
/v1/messages/count_tokens), with Anthropic's field names and bounds.

Like the OpenAI models, unknown fields are ignored (the SDKs send fields this server has no use
for: cache_control, citations, service_tier...). Block types the server cannot serve (images,
documents) are still modelled, so the handler can refuse them with a message naming the block
instead of pydantic's "tag does not match" error. The translation to the chat machinery lives
in anthropic_requests.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- content blocks ---------------------------------------------------------------------

class TextBlockParam(AnthropicBaseModel):
    type: Literal["text"]
    text: str


class ImageBlockParam(AnthropicBaseModel):
    # A user turn's image (base64 or URL source): a vision-language model takes it as the
    # chat API's image_url part; elsewhere it is refused by name.
    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlockParam(AnthropicBaseModel):
    type: Literal["document"]
    source: dict[str, Any] | None = None


class ToolUseBlockParam(AnthropicBaseModel):
    """A call the assistant made, sent back in the conversation's history."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(AnthropicBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[Annotated[Union[TextBlockParam, ImageBlockParam,
                                             DocumentBlockParam],
                                       Field(discriminator="type")]], None] = None
    # No chat template has a slot for it: accepted, and the model reads the content as is.
    is_error: bool | None = None


class ThinkingBlockParam(AnthropicBaseModel):
    """The assistant's thinking from an earlier turn (clients send it back with tool results)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(AnthropicBaseModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[Union[TextBlockParam, ImageBlockParam, DocumentBlockParam,
                               ToolUseBlockParam, ToolResultBlockParam, ThinkingBlockParam,
                               RedactedThinkingBlockParam],
                         Field(discriminator="type")]


class MessageParam(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


# ---- tools, tool_choice, thinking -------------------------------------------------------

class ToolParam(AnthropicBaseModel):
    # Only client tools: Anthropic's server tools (bash_..., web_search_...) run on
    # Anthropic's side and have no meaning here.
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    # Anthropic's strict tool use: the call's input is constrained to the schema (the chat
    # route's `strict` functions, enforced by a grammar under tool_choice auto).
    strict: bool | None = None


class ToolChoiceParam(AnthropicBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # for type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfigParam(AnthropicBaseModel):
    # "adaptive" (the model decides how much to think) reads as "enabled" here.
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)


# ---- requests ---------------------------------------------------------------------------

class CountTokensRequest(AnthropicBaseModel):
    """POST /v1/messages/count_tokens: what shapes the prompt, without the sampling fields."""

    model: str = Field(min_length=1)
    # Anthropic's limit on messages in one request; the body size bounds them first.
    messages: list[MessageParam] = Field(min_length=1, max_length=100_000)
    system: Union[str, list[TextBlockParam], None] = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfigParam | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, unused
    # Holds `effort` (accepted, unused) and `format` (structured output: refused).
    output_config: dict[str, Any] | None = None
