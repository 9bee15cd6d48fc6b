"""What the completions and chat handlers share: errors, request -> SamplingParams, context
length checks, logprob formatting, usage, SSE framing, and running engine streams with
client-disconnect detection."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from dataclasses import fields as dataclass_fields
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

from pydantic import BaseModel

from folio.config import RequestLimitsConfig
from folio.engine.async_llm import EngineDeadError
from folio.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionTopLogprob,
    CompletionLogProbs,
    PromptTokensDetails,
    UsageInfo,
)
from folio.outputs import Logprob, PositionLogprobs, RequestOutput
from folio.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

IsDisconnected = Callable[[], Awaitable[bool]]

SSE_DONE = "data: [DONE]\n\n"

# JSON has no -inf; OpenAI reports impossible tokens with this floor.
_MIN_LOGPROB = -9999.0


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error the server returns as OpenAI's {"error": {...}} body with `status_code`."""

    def __init__(self, message: str, *, status_code: int = 400,
                 type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def to_response_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def __repr__(self) -> str:
        return (f"OpenAIError({self.message!r}, status_code={self.status_code}, "
                f"type={self.type!r}, param={self.param!r})")


class ClientDisconnected(Exception):
    """The client went away while we were waiting on the engine."""


# Union members show up in pydantic error locations as type tags ("list[int]", "str");
# they are not part of the path a client can act on.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|bytes|none|dict|list|tuple|set)(\[.*\])?$|[\[\](]")


def _format_loc(loc: Sequence[Any]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and not _TYPE_TAG.search(item):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def validation_error_to_openai(exc: Any) -> OpenAIError:
    """A pydantic ValidationError (or FastAPI's RequestValidationError: anything with
    `.errors()`) as a 400 whose param is the offending field's path."""
    errors = list(exc.errors()) if hasattr(exc, "errors") else []
    if not errors:
        return OpenAIError(str(exc))
    first = errors[0]
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":  # FastAPI: the body is not JSON at all
        return OpenAIError(f"The request body is not valid JSON: {message}")
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes body fields with "body"
        loc = loc[1:]
    param = _format_loc(loc)
    if param:
        message = f"Invalid value for '{param}': {message}"
    else:
        message = f"Invalid request body: {message}"
    # A union reports one error per member; one is enough to fix the request.
    return OpenAIError(message, param=param)


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def param_from_message(message: str, known: set[str],
                       aliases: Mapping[str, str] | None = None) -> str | None:
    """SamplingParams and the engine start error messages with the field name; map it to
    the request field the client actually sent."""
    match = _LEADING_NAME.match(message)
    if match is None:
        return None
    name = match.group(1)
    if aliases and name in aliases:
        return aliases[name]
    return name if name in known else None


def to_openai_error(exc: BaseException, *, known_params: set[str] | None = None,
                    aliases: Mapping[str, str] | None = None,
                    default_param: str | None = None) -> OpenAIError:
    """Any error from building or running a request as the OpenAIError to return."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        # Dead, or shutting down: the server cannot serve it, the request was fine.
        return OpenAIError(f"The engine is not available: {exc}", status_code=503,
                           type="ServiceUnavailableError")
    if isinstance(exc, ValueError):
        message = str(exc)
        param = param_from_message(message, known_params or set(), aliases) or default_param
        return OpenAIError(message, param=param)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", status_code=500,
                       type="InternalServerError")


# ---------------------------------------------------------------------------------------
# Request checks and SamplingParams
# ---------------------------------------------------------------------------------------


def resolve_model_name(requested: str | None, served_model_names: Sequence[str]) -> str:
    if not requested:
        return served_model_names[0]
    if requested in served_model_names:
        return requested
    raise OpenAIError(f"The model `{requested}` does not exist.", status_code=404,
                      type="NotFoundError", param="model", code="model_not_found")


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


# ---------------------------------------------------------------------------------------
# Logprobs and usage
# ---------------------------------------------------------------------------------------


def clamp_logprob(value: float) -> float:
    if math.isnan(value):
        return _MIN_LOGPROB
    return max(value, _MIN_LOGPROB)


def token_text(tokenizer: Any, token_id: int, entry: Logprob | None = None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _top_entries(position: PositionLogprobs, limit: int) -> list[tuple[int, Logprob]]:
    """The position's alternatives with rank <= limit, best first."""
    ranked = [(tid, lp) for tid, lp in position.items()
              if lp.rank is not None and lp.rank <= limit]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:limit]


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        tokenizer: Any, *, num_top: int, initial_offset: int = 0
                        ) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy completions format. A None position (the first prompt token, which
    has nothing to condition on) gets null logprobs, as OpenAI's echo does. Returns the
    logprobs and the text offset after the last token (for the next stream chunk)."""
    result = CompletionLogProbs()
    offset = initial_offset
    for tid, position in zip(token_ids, positions):
        entry = position.get(tid) if position is not None else None
        text = token_text(tokenizer, tid, entry)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp_logprob(entry.logprob) if entry is not None else None)
        top: dict[str, float] = {}
        for alt_id, alt in _top_entries(position, num_top):
            top.setdefault(token_text(tokenizer, alt_id, alt), clamp_logprob(alt.logprob))
        if entry is not None:
            # OpenAI always lists the chosen token among the top alternatives.
            top.setdefault(text, clamp_logprob(entry.logprob))
        result.top_logprobs.append(top)
    return result, offset


def _chat_logprob(tokenizer: Any, tid: int, entry: Logprob | None) -> ChatCompletionTopLogprob:
    text = token_text(tokenizer, tid, entry)
    logprob = clamp_logprob(entry.logprob) if entry is not None else _MIN_LOGPROB
    return ChatCompletionTopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs] | None,
                  tokenizer: Any, *, num_top: int) -> ChatCompletionLogProbs:
    content: list[ChatCompletionLogProbsContent] = []
    for tid, position in zip(token_ids, positions or []):
        chosen = _chat_logprob(tokenizer, tid, position.get(tid))
        top = [_chat_logprob(tokenizer, alt_id, alt)
               for alt_id, alt in _top_entries(position, num_top)]
        content.append(ChatCompletionLogProbsContent(**chosen.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: Sequence[PositionLogprobs | None] | None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs extra: per prompt token None or {token_id: {logprob, rank,
    decoded_token}}."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for position in prompt_logprobs:
        if position is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                               "decoded_token": lp.decoded_token}
                    for tid, lp in position.items()})
    return out


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# ---------------------------------------------------------------------------------------
# SSE
# ---------------------------------------------------------------------------------------


def sse_event(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse_event(error.to_response_body())


# ---------------------------------------------------------------------------------------
# Running engine streams
# ---------------------------------------------------------------------------------------

_END = object()
_DISCONNECTED = object()


class EngineStreams:
    """Drives one engine stream per prompt concurrently and hands out (prompt_index,
    RequestOutput) in arrival order.

    Each stream runs in its own task, so cancelling the task (aclose) throws into the
    engine's generator at its await: its `finally` aborts the request in the engine. A
    watcher polls `is_disconnected` so a client that leaves is noticed even while no
    output arrives (non-streaming requests can wait a long time for the final output).
    """

    def __init__(self, streams: Sequence[AsyncIterator[RequestOutput]], *,
                 is_disconnected: IsDisconnected | None = None,
                 poll_interval_s: float = 0.5) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._watcher: asyncio.Task | None = None
        if is_disconnected is not None:
            self._watcher = asyncio.create_task(self._watch(is_disconnected, poll_interval_s))
        self._closed = False

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))
        else:
            self._queue.put_nowait((index, _END))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()  # no-op if the generator already finished
                except Exception:  # noqa: BLE001
                    pass

    async def _watch(self, is_disconnected: IsDisconnected, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                gone = await is_disconnected()
            except Exception:  # noqa: BLE001 - a broken probe must not fail the request
                return
            if gone:
                self._queue.put_nowait((-1, _DISCONNECTED))
                return

    def __aiter__(self) -> "EngineStreams":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open > 0:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if item is _DISCONNECTED:
                raise ClientDisconnected("the client disconnected")
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Cancel whatever is still running (aborting those engine requests)."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        if self._watcher is not None:
            tasks.append(self._watcher)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------
# What both handlers do around the engine
# ---------------------------------------------------------------------------------------


class ServingBase:
    """Engine access shared by the completions and chat handlers."""

    # How often a waiting non-streaming request asks whether its client is still there.
    disconnect_poll_interval_s: float = 0.5

    def __init__(self, engine: Any, served_model_names: Sequence[str]) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.served_model_names = list(served_model_names)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limits(self) -> RequestLimitsConfig:
        config = getattr(self.engine, "config", None)
        return getattr(config, "limits", None) or RequestLimitsConfig()

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Per-request work that can take long (templates, tokenizing, constraint checks,
        big responses) runs on the engine's preprocessing thread, not on the event loop."""
        runner = getattr(self.engine, "run_blocking", None)
        if runner is None:  # stand-in engines in tests
            return fn(*args)
        return await runner(fn, *args)

    def start_streams(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                      request_ids: Sequence[str], request: Any,
                      is_disconnected: IsDisconnected | None) -> EngineStreams:
        streams = [self.engine.generate(prompt, p, rid, priority=request.priority,
                                        cache_salt=request.cache_salt)
                   for prompt, p, rid in zip(prompts, params, request_ids)]
        return EngineStreams(streams, is_disconnected=is_disconnected,
                             poll_interval_s=self.disconnect_poll_interval_s)

    async def collect_final(self, streams: EngineStreams, count: int,
                            error_kwargs: Mapping[str, Any]) -> list[RequestOutput]:
        """Wait for every prompt's final output (FINAL_ONLY), aborting all on disconnect."""
        finals: list[RequestOutput | None] = [None] * count
        try:
            async for index, output in streams:
                finals[index] = output
        except ClientDisconnected as exc:
            raise OpenAIError("Client disconnected", status_code=499,
                              type="ClientDisconnected") from exc
        except Exception as exc:
            raise to_openai_error(exc, **error_kwargs) from exc
        finally:
            await streams.aclose()
        missing = [i for i, out in enumerate(finals) if out is None]
        if missing:
            raise OpenAIError("The engine ended the request without an output", status_code=500,
                              type="InternalServerError")
        return finals  # type: ignore[return-value]

    async def first_output(self, streams: EngineStreams, error_kwargs: Mapping[str, Any]
                           ) -> tuple[int, RequestOutput] | None:
        """Streaming starts only once the engine accepted the request(s): errors up to the
        first output still become a proper HTTP error instead of an in-stream event."""
        try:
            return await streams.__anext__()
        except StopAsyncIteration:
            await streams.aclose()
            return None
        except ClientDisconnected as exc:
            await streams.aclose()
            raise OpenAIError("Client disconnected", status_code=499,
                              type="ClientDisconnected") from exc
        except BaseException as exc:
            await streams.aclose()
            if isinstance(exc, Exception):
                raise to_openai_error(exc, **error_kwargs) from exc
            raise

    async def iterate_stream(self, streams: EngineStreams,
                             first: tuple[int, RequestOutput] | None
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The primed first output, then the rest; a client gone ends it quietly."""
        if first is not None:
            yield first
        try:
            async for item in streams:
                yield item
        except ClientDisconnected:
            return
