"""A request's fields -> what the engine takes: the served model's name, request ids, the
prompt truncated and max_tokens clamped to the context, and SamplingParams (the model's
defaults for the fields the client omitted)."""
from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Any, Mapping, Sequence

from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.sampling_params import RequestOutputKind, SamplingParams


def model_not_found(requested: str) -> OpenAIError:
    """vLLM's body for a `model` the server does not serve (its code is the HTTP status)."""
    return OpenAIError(f"The model `{requested}` does not exist.", status_code=404,
                       type="NotFoundError", param="model", code=404)


def resolve_model_name(requested: str | None, served_model_names: Sequence[str]) -> str:
    if not requested:
        return served_model_names[0]
    if requested in served_model_names:
        return requested
    raise model_not_found(requested)


def with_prefix(prefix: str, request_id: str) -> str:
    return request_id if request_id.startswith(prefix) else prefix + request_id


def check_stream_options(request: Any) -> None:
    if request.stream_options is not None and not request.stream:
        raise OpenAIError("stream_options can only be set when stream is true",
                          param="stream_options")


def truncate_prompt(ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """Keep the end of the prompt (as vLLM and the engine do); -1 means max_model_len."""
    if truncate is None:
        return ids
    keep = max_model_len if truncate == -1 else truncate
    return ids[-keep:]


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, *,
                       param: str, prompt_kind: str) -> int:
    """The request's max_tokens clamped to the room the prompt leaves (vLLM's rule), or all
    that room when omitted. 400 when the prompt leaves no room, or for a value larger than
    the whole context (no prompt could leave that much: a mistake or an attack)."""
    if prompt_len >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens ({prompt_len} in the {prompt_kind}), which "
            f"leaves no room for the completion. Please reduce the length of the {prompt_kind}.",
            param=prompt_kind, code="context_length_exceeded")
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > max_model_len:
        raise OpenAIError(
            f"{param} must be at most the model's maximum context length of {max_model_len} "
            f"tokens, got {requested}", param=param, code="context_length_exceeded")
    if requested >= 1:
        return min(requested, room)
    return requested  # < 1 is left to SamplingParams, which names the field


# Request fields copied one-to-one into SamplingParams when the client sets them.
_DIRECT_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs",
)

SAMPLING_PARAM_NAMES = {f.name for f in dataclass_fields(SamplingParams) if f.init}


def build_sampling_params(request: Any, defaults: SamplingParams, *, max_tokens: int,
                          logprobs: int | None, prompt_logprobs: int | None, stream: bool,
                          aliases: Mapping[str, str] | None = None,
                          structured_outputs: Any = None) -> SamplingParams:
    """Request -> SamplingParams. Fields the client omitted keep the model's defaults
    (generation_config); SamplingParams' ValueError becomes a 400 naming the field."""
    kwargs: dict[str, Any] = {name: getattr(defaults, name) for name in SAMPLING_PARAM_NAMES}
    for name in _DIRECT_FIELDS:
        value = getattr(request, name, None)
        if value is not None:
            kwargs[name] = value
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    kwargs["prompt_logprobs"] = prompt_logprobs
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    kwargs["structured_outputs"] = structured_outputs
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise to_openai_error(exc, known_params=SAMPLING_PARAM_NAMES, aliases=aliases) from exc
