"""POST /v1/completions: the legacy OpenAI completions endpoint on the engine."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from folio.engine.input_processor import encode_prompt
from folio.entrypoints.openai.request_checks import check_constraint_sizes
from folio.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from folio.entrypoints.openai.engine_streams import EngineStreams, IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.entrypoints.openai.request_constraints import (ConstraintContext, constraint_context,
                                                          request_constraint)
from folio.entrypoints.openai.request_params import (SAMPLING_PARAM_NAMES, build_sampling_params,
                                                     check_stream_options, resolve_max_tokens,
                                                     truncate_prompt, with_prefix)
from folio.entrypoints.openai.response_fields import (completion_logprobs, make_usage,
                                                      prompt_logprobs_json)
from folio.entrypoints.openai.serving_base import ServingBase
from folio.entrypoints.openai.serving_models import OpenAIServingModels
from folio.entrypoints.openai.sse import SSE_DONE, sse_error, sse_event
from folio.request_outputs import CompletionOutput, PositionLogprobs, RequestOutput
from folio.sampling_params import SamplingParams

_REQUEST_FIELDS = set(CompletionRequest.model_fields)
# Engine/SamplingParams errors name these; the client knows them by the request's names.
_ERROR_KWARGS: dict[str, Any] = {"known_params": _REQUEST_FIELDS | SAMPLING_PARAM_NAMES,
                                 "aliases": {"prompt_token_ids": "prompt"},
                                 "default_param": None}


@dataclass
class _Prompt:
    """One element of `prompt`, tokenized and truncated."""

    text: str | None  # None for token-id prompts (decoded lazily for echo)
    token_ids: list[int]


@dataclass
class _ChoiceState:
    """Per-choice progress of a stream."""

    started: bool = False
    text_offset: int = 0
    num_tokens: int = 0


class OpenAIServingCompletion(ServingBase):
    def __init__(self, engine: Any, served_model_names: list[str], *,
                 default_chat_template: str | None = None,
                 models: OpenAIServingModels | None = None) -> None:
        super().__init__(engine, served_model_names, models)
        # Not used by completions; accepted so the server can build both handlers alike.
        self.default_chat_template = default_chat_template

    # ---- request -> engine inputs -------------------------------------------------------

    @staticmethod
    def _prompt_items(prompt: Any) -> list[Any]:
        """string | list[str] | list[int] | list[list[int]] -> the list of prompts."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]  # a single prompt of token ids
        return list(prompt)

    def _parse_prompts(self, items: list[Any], truncating: bool) -> list[_Prompt]:
        """One tokenized _Prompt per element."""
        if not items:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                # Same tokenization as the engine's for a text prompt (special tokens on).
                out.append(_Prompt(item, encode_prompt(self.tokenizer, item,
                                                       self.engine.max_model_len,
                                                       truncating=truncating)))
            else:
                out.append(_Prompt(None, list(item)))
            if not out[-1].token_ids:
                raise OpenAIError("prompt must not be empty", param="prompt")
        return out

    def _check_unsupported(self, request: CompletionRequest) -> None:
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        n = request.n if request.n is not None else 1
        if request.best_of is not None and request.best_of != n:
            raise OpenAIError(f"best_of must be equal to n ({n}): best_of > n is not supported",
                              param="best_of")
        check_stream_options(request)

    def _build_params(self, request: CompletionRequest, prompt_len: int,
                      constraint: Any) -> SamplingParams:
        max_tokens = resolve_max_tokens(request.max_tokens, prompt_len,
                                        self.engine.max_model_len, param="max_tokens",
                                        prompt_kind="prompt")
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            # Echoed prompt tokens need their own logprobs, with as many alternatives.
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        return build_sampling_params(request, self.engine.default_sampling_params(),
                                     max_tokens=max_tokens, logprobs=request.logprobs,
                                     prompt_logprobs=prompt_logprobs,
                                     stream=bool(request.stream),
                                     structured_outputs=constraint)

    def _prepare(self, request: CompletionRequest, ctx: ConstraintContext
                 ) -> tuple[list[_Prompt], list[SamplingParams]]:
        """Tokenize, truncate and build each prompt's SamplingParams (on the preprocessing
        thread: this is the part whose cost grows with the request)."""
        items = self._prompt_items(request.prompt)
        limit = self.limits.max_prompts
        if len(items) > limit:
            raise OpenAIError(f"prompt has {len(items)} prompts; at most {limit} are allowed "
                              f"in one request (--max-prompts)", param="prompt")
        try:
            prompts = self._parse_prompts(items, request.truncate_prompt_tokens is not None)
        except ValueError as exc:
            raise to_openai_error(exc, default_param="prompt") from exc
        constraint = request_constraint(request, ctx)
        max_model_len = self.engine.max_model_len
        params = []
        for prompt in prompts:
            truncated = truncate_prompt(prompt.token_ids, request.truncate_prompt_tokens,
                                        max_model_len)
            if len(truncated) != len(prompt.token_ids):
                prompt.token_ids, prompt.text = truncated, None  # text no longer matches
            params.append(self._build_params(request, len(prompt.token_ids), constraint))
        return prompts, params

    # ---- handler ----------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest, *, request_id: str,
                                is_disconnected: IsDisconnected | None = None
                                ) -> CompletionResponse | AsyncIterator[str]:
        """A CompletionResponse, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for anything wrong before the first byte."""
        model_name, lora_request = await self.resolve_model(request.model)
        self._check_unsupported(request)
        response_id = with_prefix("cmpl-", request.request_id or request_id)
        check_constraint_sizes(request, self.limits)
        ctx = constraint_context(self.engine)
        prompts, params = await self.run_blocking(self._prepare, request, ctx)

        engine_prompts = [{"prompt_token_ids": p.token_ids, "prompt": p.text} for p in prompts]
        # One engine request per prompt; a single prompt keeps the client-visible id.
        ids = ([response_id] if len(prompts) == 1
               else [f"{response_id}-{i}" for i in range(len(prompts))])
        created = int(time.time())
        streams = self.start_streams(engine_prompts, params, ids, request, is_disconnected,
                                     lora_request)
        if request.stream:
            first = await self.first_output(streams, _ERROR_KWARGS)
            return self._stream(request, response_id, model_name, created, prompts, params,
                                streams, first)
        finals = await self.collect_final(streams, len(prompts), _ERROR_KWARGS)
        # Detokenizing n choices' logprobs can take a while: off the event loop too.
        response = await self.run_blocking(self._response, request, response_id, model_name,
                                           created, prompts, params, finals)
        response.structured_outputs_notice = ctx.notice
        return response

    # ---- output formatting ------------------------------------------------------------

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _choice_payload(self, request: CompletionRequest, prompt: _Prompt,
                        output: RequestOutput, completion: CompletionOutput, *,
                        with_prompt: bool, text_offset: int
                        ) -> tuple[str, CompletionLogProbs | None, int]:
        """The choice's text and legacy logprobs (with the echoed prompt first if
        `with_prompt`); also the text offset after it."""
        text = completion.text
        token_ids: list[int] = list(completion.token_ids)
        positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
        if with_prompt:
            text = self._prompt_text(prompt) + text
            if request.logprobs is not None:
                prompt_positions = list(output.prompt_logprobs or [])
                prompt_positions += [None] * (len(prompt.token_ids) - len(prompt_positions))
                token_ids = prompt.token_ids + token_ids
                positions = prompt_positions + positions
        if request.logprobs is None:
            return text, None, text_offset
        logprobs, offset = completion_logprobs(token_ids, positions, self.tokenizer,
                                               num_top=request.logprobs,
                                               initial_offset=text_offset)
        return text, logprobs, offset

    def _response(self, request: CompletionRequest, response_id: str, model_name: str,
                  created: int, prompts: Sequence[_Prompt], params: Sequence[SamplingParams],
                  finals: Sequence[RequestOutput]) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        completion_tokens = cached = 0
        for i, (prompt, output) in enumerate(zip(prompts, finals)):
            n = params[i].n
            cached += output.num_cached_tokens
            for completion in sorted(output.outputs, key=lambda c: c.index):
                completion_tokens += len(completion.token_ids)
                text, logprobs, _ = self._choice_payload(
                    request, prompt, output, completion, with_prompt=bool(request.echo),
                    text_offset=0)
                choices.append(CompletionResponseChoice(
                    index=i * n + completion.index, text=text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                    prompt_logprobs=(prompt_logprobs_json(output.prompt_logprobs)
                                     if request.prompt_logprobs is not None else None),
                    prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
                    token_ids=list(completion.token_ids) if request.return_token_ids else None))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(id=response_id, created=created, model=model_name,
                                  choices=choices,
                                  usage=make_usage(prompt_tokens, completion_tokens, cached),
                                  kv_transfer_params=(finals[0].kv_transfer_params
                                                      if len(finals) == 1 else None))

    async def _stream(self, request: CompletionRequest, response_id: str, model_name: str,
                      created: int, prompts: Sequence[_Prompt], params: Sequence[SamplingParams],
                      streams: EngineStreams, first: tuple[int, RequestOutput] | None
                      ) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        states: dict[int, _ChoiceState] = {}
        cached: dict[int, int] = {}
        completion_tokens = 0

        def chunk(choices: list[CompletionResponseStreamChoice], usage: Any = None) -> str:
            return sse_event(CompletionStreamResponse(
                id=response_id, created=created, model=model_name, choices=choices, usage=usage))

        try:
            async for i, output in self.iterate_stream(streams, first):
                prompt = prompts[i]
                cached[i] = output.num_cached_tokens
                for completion in output.outputs:
                    index = i * params[i].n + completion.index
                    state = states.setdefault(index, _ChoiceState())
                    first_chunk = not state.started
                    if (not first_chunk and not completion.text and not completion.token_ids
                            and completion.finish_reason is None):
                        continue  # nothing moved for this choice
                    state.started = True
                    state.num_tokens += len(completion.token_ids)
                    completion_tokens += len(completion.token_ids)
                    text, logprobs, state.text_offset = self._choice_payload(
                        request, prompt, output, completion,
                        with_prompt=bool(request.echo) and first_chunk,
                        text_offset=state.text_offset)
                    choice = CompletionResponseStreamChoice(
                        index=index, text=text, logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_token_ids=(prompt.token_ids if request.return_token_ids
                                          and first_chunk else None),
                        token_ids=(list(completion.token_ids) if request.return_token_ids
                                   else None))
                    usage = (make_usage(prompt_tokens, completion_tokens, sum(cached.values()))
                             if continuous_usage else None)
                    yield chunk([choice], usage)
            if include_usage:
                yield chunk([], make_usage(prompt_tokens, completion_tokens,
                                           sum(cached.values())))
        except Exception as exc:  # after the first byte errors can only travel in-stream
            yield sse_error(to_openai_error(exc, **_ERROR_KWARGS))
        finally:
            await streams.aclose()
        yield SSE_DONE
