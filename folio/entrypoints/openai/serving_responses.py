"""POST /v1/responses and the stored responses' routes: OpenAI's Responses API on the chat
route's machinery, with state.

The request (and the stored conversation its previous_response_id names) becomes a
ChatCompletionRequest (responses_requests.py) and runs through OpenAIServingChat's own steps:
its checks, its preparation (chat template, tokenizing, max_tokens bounded by the context,
SamplingParams with the request limits, the grammars of a forced tool call or a json_schema),
its engine streams (client-disconnect aborts, LoRA adapters) and its parsers (reasoning, tool
calls). The reply is built as OpenAI's response object and events (responses_output.py,
responses_events.py).

store=true keeps the finished response in the ResponseStore (responses_store.py), with the
whole conversation that led to it, for previous_response_id, retrieval and /input_items.
background=true answers at once (status queued) and runs the response as an asyncio task,
at most --responses-max-background at a time; a poll shows its output so far, and cancel
aborts its engine request.

A stored response's engine request carries a KV pin time-to-live (--responses-kv-pin-ttl):
the engine keeps its cached blocks out of the prefix cache's eviction for that long, so the
continuation that names it computes only its new tokens; the store's deletions (DELETE, LRU,
TTL) end the pin at once.
"""
from __future__ import annotations

import asyncio
import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from folio.entrypoints.openai.engine_streams import EngineStreams, IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.entrypoints.openai.protocol import ChatCompletionRequest
from folio.entrypoints.openai.reasoning_parsers import ReasoningParser, split_reasoning
from folio.entrypoints.openai.request_checks import check_constraint_sizes
from folio.entrypoints.openai.request_constraints import constraint_context
from folio.entrypoints.openai.responses_events import (RESPONSE_COMPLETED, RESPONSE_CREATED,
                                                       RESPONSE_FAILED, RESPONSE_IN_PROGRESS,
                                                       RESPONSE_INCOMPLETE, ResponseEvents)
from folio.entrypoints.openai.responses_output import (CANCELLED, COMPLETED, FAILED,
                                                       FINAL_STATUSES, IN_PROGRESS, INCOMPLETE,
                                                       ITEM_COMPLETED, ITEM_INCOMPLETE, QUEUED,
                                                       ResponseRecord, error_body,
                                                       new_response_id, output_items, usage,
                                                       with_item_ids)
from folio.entrypoints.openai.responses_protocol import (INPUT_ITEMS, ITEM_REFERENCE,
                                                         REASONING, ResponsesRequest)
from folio.entrypoints.openai.responses_requests import (check_request, echo_fields,
                                                         request_items, response_tools,
                                                         responses_field_names,
                                                         to_chat_request)
from folio.entrypoints.openai.responses_store import (ResponsesConfig, ResponseStore,
                                                      StoredResponse)
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.entrypoints.openai.tool_parsers import ToolParser
from folio.lora.request import LoRARequest
from folio.request_outputs import RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The engine's finish reason when the output ran out of tokens.
_LENGTH = "length"
# /input_items: OpenAI's page size bounds and default.
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
_ORDERS = ("asc", "desc")


@dataclass
class _Run:
    """One response between the request and its final status."""

    request: ResponsesRequest
    chat_request: ChatCompletionRequest
    record: ResponseRecord
    # The conversation before the output: the stored one it continues, then its own input.
    conversation: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams
    error_kwargs: dict[str, Any]
    output_ids: list[int] = field(default_factory=list)


@dataclass
class _Background:
    run: _Run
    task: asyncio.Task | None = None
    # stream=true too: the events go to this queue (None ends them); the task runs on
    # whether or not the client is still reading.
    events: asyncio.Queue | None = None


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"No response found with id '{response_id}'.", status_code=404,
                       param="response_id")


class OpenAIServingResponses(OpenAIServingChat):
    """The chat handler answering in the Responses API's shapes, with a store of finished
    responses and the background runs (the chat handler's constructor arguments, plus the
    Responses flags)."""

    def __init__(self, engine: Any, served_model_names: list[str], *,
                 config: ResponsesConfig | None = None, **chat_options: Any) -> None:
        super().__init__(engine, served_model_names, **chat_options)
        self.config = config or ResponsesConfig()
        pinning = self.config.kv_pin_ttl_s > 0
        self.store = ResponseStore(self.config.store_max_entries, self.config.store_ttl_s,
                                   self.config.store_path,
                                   on_delete=self._unpin_kv if pinning else None)
        self._background: dict[str, _Background] = {}
        # The unpin calls in flight (the loop keeps only weak references to tasks).
        self._unpins: set[asyncio.Task] = set()

    # ---- create ---------------------------------------------------------------------------

    async def create_response(self, request: ResponsesRequest, *,
                              is_disconnected: IsDisconnected | None = None
                              ) -> dict[str, Any] | AsyncIterator[str]:
        """The response object, or (stream=true) an async iterator of SSE strings. Raises
        OpenAIError for anything wrong before the first byte."""
        try:
            return await self._create(request, is_disconnected)
        except OpenAIError as exc:
            raise responses_field_names(exc) from None

    def _previous(self, response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a previous_response_id continues (empty without one)."""
        if response_id is None:
            return []
        running = self._background.get(response_id)
        if running is not None:
            raise OpenAIError(f"Previous response with id '{response_id}' is still "
                              f"{running.run.record.status}; continue it once it has finished",
                              param="previous_response_id")
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Previous response with id '{response_id}' not found.",
                              status_code=404, param="previous_response_id",
                              code="previous_response_not_found")
        return entry.conversation()

    def _resolve_references(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request's own items with each item_reference replaced by the stored item it
        names."""
        resolved = []
        for i, item in enumerate(items):
            if item["type"] == ITEM_REFERENCE:
                stored = self.store.item(item["id"])
                if stored is None:
                    raise OpenAIError(f"input[{i}]: no stored item with id '{item['id']}' "
                                      "(item_reference names an item of a stored response)",
                                      status_code=404, param=f"input[{i}].id")
                item = stored
            resolved.append(item)
        return resolved

    def _chat_request(self, request: ResponsesRequest, previous: list[dict[str, Any]],
                      own: list[dict[str, Any]], tools: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        # Parsed again (on the preprocessing thread: a long conversation is many items): the
        # stored conversation, and the request's own items with their references resolved.
        items = INPUT_ITEMS.validate_python(previous + own)
        chat_request = to_chat_request(request, items, len(previous), tools,
                                       self._thinking_kwargs())
        check_constraint_sizes(chat_request, self.limits)  # tools count, schema size/depth
        return chat_request

    async def _create(self, request: ResponsesRequest, is_disconnected: IsDisconnected | None
                      ) -> dict[str, Any] | AsyncIterator[str]:
        check_request(request)
        model_name, lora_request = await self.resolve_model(request.model)
        previous = self._previous(request.previous_response_id)
        tools = response_tools(request, self.limits.max_tools)
        own = self._resolve_references(request_items(request))
        chat_request = await self.run_blocking(self._chat_request, request, previous, own,
                                               tools)
        self._check_unsupported(chat_request)
        ctx = constraint_context(self.engine)
        text, token_ids, params = await self.run_blocking(self._prepare, chat_request, ctx)
        record = ResponseRecord(new_response_id(), model_name,
                                echo_fields(request, tools, params.temperature, params.top_p),
                                status=QUEUED if request.background else IN_PROGRESS)
        # Ids once the translation has refused the item types it cannot serve.
        run = _Run(request, chat_request, record, previous + with_item_ids(own), token_ids,
                   params, self._error_kwargs(chat_request))
        if request.background:
            # Checked with no await before the run is registered: the bound is exact.
            if len(self._background) >= self.config.max_background:
                raise OpenAIError(f"{len(self._background)} background responses are running, "
                                  "the most this server runs at once "
                                  "(--responses-max-background); retry later", status_code=429,
                                  type="rate_limit_error", code="rate_limit_exceeded")
            return self._start_background(run, self._submit_engine_request(run, text,
                                                                           lora_request, None))
        streams = self._submit_engine_request(run, text, lora_request, is_disconnected)
        if request.stream:
            first = await self.first_output(streams, run.error_kwargs)
            return self._events(run, streams, first)
        [output] = await self.collect_final(streams, 1, run.error_kwargs)
        # The parsers read the whole reply: off the event loop, as the chat route does.
        await self.run_blocking(self._finish, run, output)
        self._keep(run)
        return record.body()

    def _submit_engine_request(self, run: _Run, prompt_text: str,
                               lora_request: LoRARequest | None,
                               is_disconnected: IsDisconnected | None) -> EngineStreams:
        """The one place a Responses request reaches the engine (its request id is the
        response's id). A continuation's prompt starts with the tokens of the response it
        continues (StoredResponse.token_ids), which the prefix cache reuses while their
        blocks are still cached: a response to be stored has its blocks pinned for
        --responses-kv-pin-ttl seconds once it finishes, so they are."""
        pin = self.config.kv_pin_ttl_s if run.request.store and self.config.kv_pin_ttl_s else None
        return self.start_streams([{"prompt_token_ids": run.prompt_ids, "prompt": prompt_text}],
                                  [run.params], [run.record.id], run.chat_request,
                                  is_disconnected, lora_request, kv_pin_ttl=pin)

    def _unpin_kv(self, response_id: str) -> None:
        """The store let the response go: end its KV pin (a no-op in the engine when it has
        none, or it has expired). Called on the event loop; the call itself runs as a task."""
        task = asyncio.get_running_loop().create_task(self._call_unpin(response_id))
        self._unpins.add(task)
        task.add_done_callback(self._unpins.discard)

    async def _call_unpin(self, response_id: str) -> None:
        try:
            await self.engine.unpin_kv([response_id])
        except Exception as exc:  # the engine is gone: its pins went with it
            logger.debug("unpinning %s failed: %s", response_id, exc)

    def _keep(self, run: _Run) -> None:
        """Store the response (store=true), once it has its final status."""
        if not run.request.store:
            return
        self.store.put(StoredResponse(run.record.id, run.record.body(), run.conversation,
                                      array("i", run.prompt_ids + run.output_ids)))

    def _max_calls(self, request: ResponsesRequest) -> int | None:
        return 1 if request.parallel_tool_calls is False else request.max_tool_calls

    def _count_tokens(self, text: str | None) -> int:
        # usage.output_tokens_details.reasoning_tokens: the reasoning text, tokenized again
        # (the parser splits text, not tokens).
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    # ---- the reply, whole -----------------------------------------------------------------

    def _finish(self, run: _Run, output: RequestOutput) -> None:
        completion = output.outputs[0]
        reasoning, content = None, completion.text
        parser = self._reasoning_parser(run.chat_request)
        if parser is not None:
            reasoning, content = parser.extract(completion.text)
        calls: list[tuple[str, str, str]] = []
        tool_parser = self._tool_parser(run.chat_request)
        if tool_parser is not None and content:
            extracted = tool_parser.extract(content)
            if extracted.tools_called:
                content = extracted.content
                calls = [(c.id, c.name, c.arguments) for c in extracted.tool_calls]
                calls = calls[:self._max_calls(run.request)]
        incomplete = completion.finish_reason == _LENGTH
        run.output_ids = list(completion.token_ids)
        record = run.record
        record.output = output_items(reasoning, content, calls, incomplete)
        record.usage = usage(len(run.prompt_ids), output.num_cached_tokens,
                             len(completion.token_ids), self._count_tokens(reasoning))
        record.finish(INCOMPLETE if incomplete else COMPLETED)

    # ---- the reply, as events -------------------------------------------------------------

    @staticmethod
    def _delta_events(events: ResponseEvents, reasoning_parser: ReasoningParser | None,
                      tool_parser: ToolParser | None, text: str, final: bool) -> list[str]:
        """One output delta split into reasoning, text and tool-call pieces, as events."""
        reasoning, content = split_reasoning(reasoning_parser, text, final)
        out = events.reasoning(reasoning) if reasoning else []
        if tool_parser is None:
            return out + (events.text(content) if content else [])
        for piece in tool_parser.stream_pieces(content, final):
            if piece.content:
                out += events.text(piece.content)
            for call in piece.tool_calls:
                if call.id is not None:
                    out += events.call_start(call.index, call.id, call.name or "")
                if call.arguments:
                    out += events.call_arguments(call.index, call.arguments)
        return out

    async def _events(self, run: _Run, streams: EngineStreams,
                      first: tuple[int, RequestOutput] | None) -> AsyncIterator[str]:
        """The response's events from response.created to .completed / .incomplete /
        .failed; the record grows with them and is kept when final. A client gone (the
        stream ends without a finish) leaves nothing kept."""
        record = run.record
        events = ResponseEvents(record, self._max_calls(run.request))
        reasoning_parser = self._reasoning_parser(run.chat_request)
        tool_parser = self._tool_parser(run.chat_request)
        finish_reason, cached = None, 0
        try:
            yield events.lifecycle(RESPONSE_CREATED)
            yield events.lifecycle(RESPONSE_IN_PROGRESS)
            async for _, output in self.iterate_stream(streams, first):
                cached = output.num_cached_tokens
                for completion in output.outputs:
                    run.output_ids += completion.token_ids
                    final = completion.finish_reason is not None
                    for event in self._delta_events(events, reasoning_parser, tool_parser,
                                                    completion.text, final):
                        yield event
                    if final:
                        finish_reason = completion.finish_reason
            if finish_reason is None:
                return
            incomplete = finish_reason == _LENGTH
            for event in events.close(ITEM_INCOMPLETE if incomplete else ITEM_COMPLETED):
                yield event
            reasoning = "".join(part["text"] for item in record.output
                                if item["type"] == REASONING for part in item["content"])
            reasoning_tokens = await self.run_blocking(self._count_tokens, reasoning)
            record.usage = usage(len(run.prompt_ids), cached, len(run.output_ids),
                                 reasoning_tokens)
            record.finish(INCOMPLETE if incomplete else COMPLETED)
            self._keep(run)
            yield events.lifecycle(RESPONSE_INCOMPLETE if incomplete else RESPONSE_COMPLETED)
        except Exception as exc:  # after the first byte errors can only travel in-stream
            error = responses_field_names(to_openai_error(exc, **run.error_kwargs))
            record.finish(FAILED, error=error_body(error.status_code, error.message))
            self._keep(run)
            yield events.lifecycle(RESPONSE_FAILED)
        finally:
            await streams.aclose()

    # ---- background -----------------------------------------------------------------------

    def _start_background(self, run: _Run, streams: EngineStreams
                          ) -> dict[str, Any] | AsyncIterator[str]:
        background = _Background(run, events=asyncio.Queue() if run.request.stream else None)
        background.task = asyncio.create_task(self._run_background(background, streams))
        self._background[run.record.id] = background
        if background.events is not None:
            return self._follow(background)
        return run.record.body()

    async def _run_background(self, background: _Background, streams: EngineStreams) -> None:
        run = background.run
        record = run.record

        def publish(event: str) -> None:
            if background.events is not None:
                background.events.put_nowait(event)

        try:
            first = await self.first_output(streams, run.error_kwargs)
            record.status = IN_PROGRESS
            async for event in self._events(run, streams, first):
                publish(event)
            if record.status not in FINAL_STATUSES:  # the engine ended it without a finish
                record.finish(FAILED, error=error_body(500, "the engine ended the request "
                                                            "without an output"))
                self._keep(run)
        except asyncio.CancelledError:
            # POST /cancel (or DELETE): the engine request was aborted as the task unwound.
            record.finish(CANCELLED)
            self._keep(run)
        except OpenAIError as exc:  # refused before its first output (e.g. 429)
            error = responses_field_names(exc)
            record.finish(FAILED, error=error_body(error.status_code, error.message))
            self._keep(run)
            publish(ResponseEvents(record).lifecycle(RESPONSE_FAILED))
        finally:
            await streams.aclose()
            self._background.pop(record.id, None)
            if background.events is not None:
                background.events.put_nowait(None)  # the end of the events

    @staticmethod
    async def _follow(background: _Background) -> AsyncIterator[str]:
        """A background response's events, for the client that created it with stream=true;
        if it leaves, the response runs on."""
        queue = background.events
        assert queue is not None
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            background.events = None

    # ---- the stored responses' routes -----------------------------------------------------

    def retrieve(self, response_id: str) -> dict[str, Any]:
        running = self._background.get(response_id)
        if running is not None:
            return running.run.record.body()
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    async def _stop(self, background: _Background) -> None:
        assert background.task is not None
        background.task.cancel()
        await asyncio.wait([background.task])

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response (its engine request aborted); one already finished
        is returned as it is, as OpenAI does."""
        running = self._background.get(response_id)
        if running is not None:
            await self._stop(running)
            return running.run.record.body()
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if not entry.response.get("background"):
            raise OpenAIError("Only responses created with background=true can be cancelled.",
                              param="response_id")
        return entry.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        running = self._background.get(response_id)
        if running is not None:
            await self._stop(running)
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, response_id: str, *, after: str | None = None,
                    limit: int = DEFAULT_LIST_LIMIT, order: str = "desc") -> dict[str, Any]:
        """OpenAI's list object of the conversation the response was given (the responses it
        continued included), `order` by position, `limit` items after the one named
        `after`."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise OpenAIError(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}",
                              param="limit")
        if order not in _ORDERS:
            raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        running = self._background.get(response_id)
        if running is not None:
            items = running.run.conversation
        else:
            entry = self.store.get(response_id)
            if entry is None:
                raise _not_found(response_id)
            items = entry.input_items
        ordered = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            ids = [item.get("id") for item in ordered]
            if after not in ids:
                raise OpenAIError(f"after: no input item with id '{after}' in response "
                                  f"'{response_id}'", param="after")
            start = ids.index(after) + 1
        page = ordered[start:start + limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(ordered)}
