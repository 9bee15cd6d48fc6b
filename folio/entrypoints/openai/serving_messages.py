"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
route's machinery.

The request becomes a ChatCompletionRequest (anthropic_requests.py) and runs through
OpenAIServingChat's own steps: its checks (tool_choice against the server's parsers), its
preparation (chat template, tokenizing, max_tokens bounded by the context, SamplingParams with
the request limits, the grammar of a forced tool call), its engine streams (client-disconnect
aborts, LoRA adapters) and its parsers (reasoning, tool calls). Only the reply's shape is
Anthropic's (anthropic_responses.py). Errors are OpenAIErrors, rendered as Anthropic's body
by the server for these routes.
"""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from folio.entrypoints.openai.anthropic_protocol import CountTokensRequest, MessagesRequest
from folio.entrypoints.openai.anthropic_requests import (anthropic_field_names,
                                                         to_chat_request)
from folio.entrypoints.openai import anthropic_responses as bodies
from folio.entrypoints.openai.engine_streams import EngineStreams, IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.reasoning_parsers import split_reasoning
from folio.entrypoints.openai.request_checks import check_constraint_sizes
from folio.entrypoints.openai.request_constraints import constraint_context
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.request_outputs import CompletionOutput, RequestOutput
from folio.sampling_params import SamplingParams


class AnthropicServingMessages(OpenAIServingChat):
    """The chat handler, answering in Anthropic's shapes (same constructor arguments)."""

    def _chat_request(self, request: CountTokensRequest) -> ChatCompletionRequest:
        chat_request = to_chat_request(request, self._thinking_kwargs(),
                                       takes_images=self._image_processor is not None)
        check_constraint_sizes(chat_request, self.limits)  # tools count, schema size/depth
        return chat_request

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        """{"input_tokens": N}: the prompt the chat template renders for this body (system,
        messages, tools), as create would send it to the engine."""
        try:
            await self.resolve_model(request.model)
            chat_request = self._chat_request(request)
            _, token_ids = await self.run_blocking(self._render, chat_request)
        except OpenAIError as exc:
            raise anthropic_field_names(exc) from None
        return {"input_tokens": len(token_ids)}

    async def create_message(self, request: MessagesRequest, *, request_id: str,
                             is_disconnected: IsDisconnected | None = None
                             ) -> dict[str, Any] | AsyncIterator[str]:
        """The message body, or (stream=true) an async iterator of SSE strings. Raises
        OpenAIError for anything wrong before the first byte."""
        try:
            return await self._create(request, request_id, is_disconnected)
        except OpenAIError as exc:
            raise anthropic_field_names(exc) from None

    async def _create(self, request: MessagesRequest, request_id: str,
                      is_disconnected: IsDisconnected | None
                      ) -> dict[str, Any] | AsyncIterator[str]:
        model_name, lora_request = await self.resolve_model(request.model)
        chat_request = self._chat_request(request)
        self._check_unsupported(chat_request)
        ctx = constraint_context(self.engine)
        prompt, token_ids, params = await self._engine_prompt(chat_request, ctx)
        message_id = "msg_" + (request_id.removeprefix("msg-") or uuid.uuid4().hex)
        error_kwargs = self._error_kwargs(chat_request)
        streams = self.start_streams([prompt], [params], [message_id], chat_request,
                                     is_disconnected, lora_request)
        if request.stream:
            first = await self.first_output(streams, error_kwargs)
            return self._stream(request, chat_request, message_id, model_name, len(token_ids),
                                params, streams, first, error_kwargs)
        [output] = await self.collect_final(streams, 1, error_kwargs)
        # The parsers read the whole reply: off the event loop, as the chat route does.
        return await self.run_blocking(self._message, request, chat_request, message_id,
                                       model_name, len(token_ids), params, output)

    # ---- the reply ------------------------------------------------------------------------

    @staticmethod
    def _stop(request: MessagesRequest, params: SamplingParams, completion: CompletionOutput,
              output_tokens: int, tool_called: bool) -> tuple[str, str | None]:
        # max_tokens was clamped to the room the prompt leaves: running out of that room is
        # the context's end, not the client's max_tokens.
        context_full = (params.max_tokens is not None and params.max_tokens < request.max_tokens
                        and output_tokens >= params.max_tokens)
        return bodies.stop_reason(completion.finish_reason, completion.stop_reason,
                                  request.stop_sequences, tool_called=tool_called,
                                  context_full=context_full)

    def _message(self, request: MessagesRequest, chat_request: ChatCompletionRequest,
                 message_id: str, model_name: str, prompt_tokens: int, params: SamplingParams,
                 output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        reasoning, content = None, completion.text
        parser = self._reasoning_parser(chat_request)
        if parser is not None:
            reasoning, content = parser.extract(completion.text)
        calls: list[tuple[str, str, str]] = []
        tool_parser = self._tool_parser(chat_request)
        if tool_parser is not None and content:
            extracted = tool_parser.extract(content)
            if extracted.tools_called:
                content = extracted.content
                found = extracted.tool_calls
                if chat_request.parallel_tool_calls is False:
                    found = found[:1]  # disable_parallel_tool_use: one call at most
                calls = [(bodies.tool_use_id(c.id), c.name, c.arguments) for c in found]
        reason, sequence = self._stop(request, params, completion, len(completion.token_ids),
                                      bool(calls))
        return bodies.message(
            message_id, model_name, bodies.content_blocks(reasoning, content, calls), reason,
            sequence, bodies.usage(prompt_tokens, len(completion.token_ids),
                                   output.num_cached_tokens))

    async def _stream(self, request: MessagesRequest, chat_request: ChatCompletionRequest,
                      message_id: str, model_name: str, prompt_tokens: int,
                      params: SamplingParams, streams: EngineStreams,
                      first: tuple[int, RequestOutput] | None,
                      error_kwargs: dict[str, Any]) -> AsyncIterator[str]:
        """message_start, ping, each block's start / deltas / stop (thinking, text, tool_use
        with its input as input_json_delta fragments), message_delta, message_stop."""
        reasoning_parser = self._reasoning_parser(chat_request)
        tool_parser = self._tool_parser(chat_request)
        one_call = chat_request.parallel_tool_calls is False
        blocks = bodies.ContentBlockEvents()
        output_tokens = 0
        reason, sequence = "end_turn", None

        def content_events(content: str | None, final: bool) -> list[str]:
            if tool_parser is None:
                return blocks.text(content) if content else []
            events: list[str] = []
            for piece in tool_parser.stream_pieces(content, final):
                if piece.content:
                    events += blocks.text(piece.content)
                for call in piece.tool_calls:
                    if call.index > 0 and one_call:
                        continue
                    if call.id is not None:
                        events += blocks.tool_start(call.index, bodies.tool_use_id(call.id),
                                                    call.name or "")
                    if call.arguments:
                        events += blocks.tool_input(call.index, call.arguments)
            return events

        def delta_events(text: str, final: bool) -> list[str]:
            reasoning, content = split_reasoning(reasoning_parser, text, final)
            events = blocks.thinking(reasoning) if reasoning else []
            return events + content_events(content, final)

        try:
            cached = first[1].num_cached_tokens if first is not None else 0
            yield bodies.message_start(message_id, model_name,
                                       bodies.usage(prompt_tokens, 0, cached))
            yield bodies.PING
            async for _, output in self.iterate_stream(streams, first):
                for completion in output.outputs:
                    output_tokens += len(completion.token_ids)
                    final = completion.finish_reason is not None
                    for event in delta_events(completion.text, final):
                        yield event
                    if final:
                        reason, sequence = self._stop(request, params, completion,
                                                      output_tokens, blocks.tool_called)
            for event in blocks.close():
                yield event
            yield bodies.message_delta(reason, sequence, output_tokens)
            yield bodies.MESSAGE_STOP
        except Exception as exc:  # after the first byte errors can only travel in-stream
            error = anthropic_field_names(to_openai_error(exc, **error_kwargs))
            yield bodies.error_event(error.status_code, error.message)
        finally:
            await streams.aclose()
