"""Pydantic models of OpenAI's Responses API requests (POST /v1/responses), with OpenAI's field
names and bounds.

Unknown fields are ignored, as on the other routes (the SDKs send fields this server has no use
for: service_tier, prompt_cache_key, safety_identifier...). Input items and content parts the
server cannot serve (images, files, audio, hosted tools' calls) are still parsed, so the
translation (responses_requests.py) refuses them with a message naming the item instead of
pydantic's "tag does not match" error. Tools stay plain objects for the same reason: a built-in
tool (web_search, file_search...) is refused by name there.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter,
                      field_validator)

# The most input items one request may carry (its own, not counting a stored conversation it
# continues); the request body's size and the context bound them first in practice.
MAX_INPUT_ITEMS = 10_000
# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Item types (the `type` of an input or output item).
MESSAGE = "message"
FUNCTION_CALL = "function_call"
FUNCTION_CALL_OUTPUT = "function_call_output"
REASONING = "reasoning"
# A stored item named by its id (clients send it instead of the item itself).
ITEM_REFERENCE = "item_reference"
# Any other type (web_search_call, computer_call...): parsed to be refused.
_UNSUPPORTED = "unsupported"

# The `type` of a Responses function tool; any other tool type is a built-in (hosted) tool.
FUNCTION_TOOL = "function"


class ResponsesBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# ---- content parts ----------------------------------------------------------------------

class InputTextPart(ResponsesBaseModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(ResponsesBaseModel):
    """An earlier answer's text, sent back as conversation history."""

    type: Literal["output_text"]
    text: str


class RefusalPart(ResponsesBaseModel):
    type: Literal["refusal"]
    refusal: str


class MediaPart(ResponsesBaseModel):
    # Parsed only to be refused by name: the models here take text only.
    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[Union[InputTextPart, OutputTextPart, RefusalPart, MediaPart],
                        Field(discriminator="type")]


class SummaryTextPart(ResponsesBaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(ResponsesBaseModel):
    type: Literal["reasoning_text"]
    text: str


# ---- input items ------------------------------------------------------------------------

class MessageItem(ResponsesBaseModel):
    """A message; `type` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = MESSAGE
    role: Literal["user", "system", "developer", "assistant"]
    # The list first: pydantic's first error (the one reported) is then the list's.
    content: Union[list[ContentPart], str]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(ResponsesBaseModel):
    """A call the model made earlier, sent back with its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(ResponsesBaseModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[list[ContentPart], str]
    id: str | None = None
    status: str | None = None


class ReasoningItem(ResponsesBaseModel):
    """The model's reasoning from an earlier turn (its text in `content`; `summary` when the
    client sends only that)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ItemReference(ResponsesBaseModel):
    """An item of a stored response, by id: the handler puts the item in its place."""

    type: Literal["item_reference"]
    id: str = Field(min_length=1)


class UnsupportedItem(ResponsesBaseModel):
    type: str


def _item_kind(value: Any) -> str:
    kind = value.get("type", MESSAGE) if isinstance(value, dict) else getattr(value, "type",
                                                                               MESSAGE)
    return kind if kind in (MESSAGE, FUNCTION_CALL, FUNCTION_CALL_OUTPUT, REASONING,
                            ITEM_REFERENCE) else _UNSUPPORTED


InputItem = Annotated[Union[Annotated[MessageItem, Tag(MESSAGE)],
                            Annotated[FunctionCallItem, Tag(FUNCTION_CALL)],
                            Annotated[FunctionCallOutputItem, Tag(FUNCTION_CALL_OUTPUT)],
                            Annotated[ReasoningItem, Tag(REASONING)],
                            Annotated[ItemReference, Tag(ITEM_REFERENCE)],
                            Annotated[UnsupportedItem, Tag(_UNSUPPORTED)]],
                      Discriminator(_item_kind)]

# Stored conversations are kept as JSON objects and parsed again when continued.
INPUT_ITEMS = TypeAdapter(list[InputItem])


# ---- tools, text format, reasoning -------------------------------------------------------------

class FunctionTool(ResponsesBaseModel):
    """A function the model may call (the request's `tools` entries of type "function")."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(ResponsesBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    # "schema" would shadow BaseModel.schema: kept under another name, read and written as
    # "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(ResponsesBaseModel):
    format: TextFormat | None = None
    # Accepted and echoed; it is a hint that folio's models have no switch for.
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(ResponsesBaseModel):
    # "none" turns the model's thinking off; any other effort turns it on; no effort leaves
    # the chat template's default.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Accepted: the reasoning comes back whole as the reasoning item's content.
    summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request ------------------------------------------------------------------------

class ResponsesRequest(ResponsesBaseModel):
    """POST /v1/responses."""

    model: str | None = None
    input: Union[Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)], str]
    instructions: str | None = None
    # Plain objects: a built-in tool is refused by name, a function tool is checked field by
    # field (responses_requests.py); their count is bounded by --max-tools.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    background: bool = False
    stream: bool = False
    # "auto" (dropping the conversation's first items to fit) is refused by the handler.
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # OpenAI's Conversations API and stored prompt templates: refused by the handler.
    conversation: Union[str, dict[str, Any], None] = None
    prompt: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE_CHARS} characters")
        return value
