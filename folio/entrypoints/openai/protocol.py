"""Pydantic v2 models of the OpenAI wire format (plus vLLM's extra request fields).

Requests ignore unknown fields (OpenAI SDKs send extras we do not know about) but reject
wrong types and out-of-range values; cross-field rules (suffix, tools, context length...)
live in the handlers, which know the model and can name the parameter precisely.
Responses serialize exactly the keys OpenAI sends; vLLM's optional extras (token ids,
prompt logprobs, usage on stream chunks) are omitted unless set.
"""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_serializer

SYSTEM_FINGERPRINT = "folio-0.1.0"


class OpenAIBaseModel(BaseModel):
    # Unknown request fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    # Keys dropped from the serialized form when their value is None: vLLM extras that
    # OpenAI clients never expect to see unless they asked for them.
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = handler(self)
        if self._omit_if_none and isinstance(data, dict):
            for key in self._omit_if_none:
                if data.get(key, 0) is None:
                    del data[key]
        return data


# ---------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # vLLM extra: usage (so far) on every chunk, not only in the final one.
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _now() -> int:
    return int(time.time())


class _SamplingFields(OpenAIBaseModel):
    """Request fields common to completions and chat (OpenAI's and vLLM's extras).

    Sampling fields default to None so the handler can tell "omitted" (use the model's
    default from generation_config) from an explicit value.
    """

    model: str | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None

    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    priority: int = 0
    # folio's own: seconds from arrival after which the request is finished with reason
    # "timeout" (what it generated so far is returned); `deadline` is the same as a Unix
    # time. At most a day.
    timeout: float | None = Field(default=None, gt=0, le=86400)
    deadline: float | None = Field(default=None, gt=0)
    return_token_ids: bool | None = False
    request_id: str | None = None
    # Constrained output: vLLM's extra (json / json_object / regex / choice / grammar /
    # structural_tag + options) and OpenAI's response_format.
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Disaggregated prefill (vLLM's): {"do_remote_decode": true} to a prefill server; the
    # kv_transfer_params of its response to a decode server (folio router does both).
    kv_transfer_params: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    # A string or a token-id list is one prompt; a list of them is several (mixing texts
    # and id lists is accepted too). Choice i*n + j is prompt i's j-th sample.
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]],
                  list[Union[str, list[StrictInt]]]]
    suffix: str | None = None
    # OpenAI's default for the legacy completions endpoint; null means "fill the context".
    max_tokens: int | None = 16
    # Legacy completions logprobs: the number of top alternatives per token.
    # Bounded by --max-logprobs (20 by default), checked with the other request limits.
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    best_of: int | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    _omit_if_none = frozenset({"prompt_logprobs", "prompt_token_ids", "token_ids"})

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    _omit_if_none = frozenset({"structured_outputs_notice", "kv_transfer_params"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    # folio: what a best_effort structured_outputs constraint left unenforced.
    structured_outputs_notice: str | None = None
    # A prefill server's answer: where a decode server fetches the prompt's KV.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    _omit_if_none = frozenset({"prompt_token_ids", "token_ids"})

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    _omit_if_none = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------


# What /openapi.json documents for a chat message (clients and fuzzers build from it); the
# handler itself validates messages with precise errors (folio.engine.chat).
_MESSAGE_SCHEMA = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
}


class ChatCompletionRequest(_SamplingFields):
    # Kept as plain dicts: folio.engine.chat validates roles/parts with precise messages,
    # and templates may read extra keys (name, tool_call_id...).
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={
        "items": _MESSAGE_SCHEMA})
    max_tokens: int | None = None
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)  # bounded by --max-logprobs
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallItem(OpenAIBaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    _omit_if_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    # Streaming: id, type and name come first; then argument fragments under the same index.
    _omit_if_none = frozenset({"id", "type", "function"})

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    # With a reasoning parser the thinking text goes in both names: clients read one or the
    # other (vLLM's `reasoning_content`, the newer `reasoning`).
    _omit_if_none = frozenset({"reasoning_content", "reasoning", "tool_calls"})

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallItem] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    _omit_if_none = frozenset({"token_ids"})

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    _omit_if_none = frozenset({"prompt_logprobs", "prompt_token_ids", "structured_outputs_notice",
                               "kv_transfer_params"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    # folio: what a best_effort structured_outputs constraint left unenforced.
    structured_outputs_notice: str | None = None
    # A prefill server's answer: where a decode server fetches the prompt's KV.
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    # A delta carries only what changed: {"role", "content": ""} first, then {"content"},
    # and {} with the finish_reason.
    _omit_if_none = frozenset({"role", "content", "reasoning_content", "reasoning", "tool_calls"})

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    _omit_if_none = frozenset({"token_ids"})

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    _omit_if_none = frozenset({"usage", "prompt_token_ids"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# ---------------------------------------------------------------------------------------
# Tokenizer routes (vLLM's /tokenize and /detokenize)
# ---------------------------------------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    # One of: a text prompt, or chat messages rendered with the chat template first.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    tokens: list[StrictInt]


# ---------------------------------------------------------------------------------------
# Run-time LoRA adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter)
# ---------------------------------------------------------------------------------------


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    # Optional here so that a missing field gets vLLM's own message, not pydantic's.
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    # vLLM accepts it; the server names adapters by lora_name and assigns the ids itself.
    lora_int_id: int | None = None
