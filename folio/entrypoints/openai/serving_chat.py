"""POST /v1/chat/completions: messages -> chat template -> the engine."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from folio.engine.chat import RenderedChat, render_chat
from folio.engine.input_processor import encode_prompt
from folio.entrypoints.openai.request_checks import check_constraint_sizes
from folio.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallItem,
)
from folio.entrypoints.openai.engine_streams import EngineStreams, IsDisconnected
from folio.entrypoints.openai.errors import OpenAIError, to_openai_error
from folio.entrypoints.openai.reasoning_parsers import (ReasoningParser, get_reasoning_parser,
                                                      split_reasoning)
from folio.entrypoints.openai.request_constraints import (
    ConstraintContext, constraint_context, forced_tool_constraint, named_function,
    request_constraint, strict_tools_constraint)
from folio.entrypoints.openai.request_params import (SAMPLING_PARAM_NAMES, build_sampling_params,
                                                     check_stream_options, resolve_max_tokens,
                                                     truncate_prompt, with_prefix)
from folio.entrypoints.openai.response_fields import (chat_logprobs, make_usage,
                                                      prompt_logprobs_json)
from folio.entrypoints.openai.serving_base import ServingBase
from folio.entrypoints.openai.serving_models import OpenAIServingModels
from folio.entrypoints.openai.sse import SSE_DONE, sse_error, sse_event
from folio.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from folio.entrypoints.openai.tool_parsers.forced import (NamedToolCallParser,
                                                          RequiredToolCallParser)
from folio.reasoning import REASONING_FORMATS
from folio.request_outputs import CompletionOutput, RequestOutput
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams

_REQUEST_FIELDS = set(ChatCompletionRequest.model_fields)


class OpenAIServingChat(ServingBase):
    def __init__(self, engine: Any, served_model_names: list[str], *,
                 chat_template: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 models: OpenAIServingModels | None = None) -> None:
        super().__init__(engine, served_model_names, models)
        # --enable-auto-tool-choice + --tool-call-parser: tool_choice "auto" parses the model's
        # own tool-call syntax out of its text ("required"/named choices need constrained
        # decoding and are refused until it is wired in).
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # Server-wide template override (--chat-template); a request's chat_template wins.
        self.chat_template = chat_template
        # --reasoning-parser: splits thinking text from the answer (KeyError names the choices).
        self.reasoning_parser_cls = (get_reasoning_parser(reasoning_parser)
                                     if reasoning_parser else None)
        # Fetches the images chats name by URL (made on the first such request).
        self._media: Any = None

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        choice = request.tool_choice
        if not request.tools or choice == "none":
            return None
        # Forced calls are shaped by a grammar, so they parse the same on every model.
        if choice == "required":
            return RequiredToolCallParser(tools=request.tools)
        if isinstance(choice, dict):
            name = named_function(request.tools, choice)["name"]
            return NamedToolCallParser(tools=request.tools, function_name=name)
        if self.tool_parser_cls is None:
            return None
        return self.tool_parser_cls(tools=request.tools)

    def _constraint(self, request: ChatCompletionRequest, ctx: ConstraintContext
                    ) -> StructuredOutputsParams | None:
        choice = request.tool_choice
        if request.tools and (choice == "required" or isinstance(choice, dict)):
            if request.response_format is not None or request.structured_outputs is not None:
                raise OpenAIError("a forced tool_choice already fixes the output's shape; "
                                  "drop response_format / structured_outputs",
                                  param="tool_choice")
            return forced_tool_constraint(request.tools, choice, request.parallel_tool_calls, ctx)
        constraint = request_constraint(request, ctx)
        if constraint is None and request.tools and choice in (None, "auto") \
                and self.tool_parser_cls is not None:
            constraint = strict_tools_constraint(request.tools, self.tool_parser_cls.name, ctx)
        return constraint

    def _thinking_kwargs(self) -> tuple[str, ...]:
        # The chat_template_kwargs that switch the served model's thinking (deepseek_v3 reads
        # "thinking"); without a reasoning parser, the common "enable_thinking". The Messages
        # and Responses APIs' thinking switches set them.
        if self.reasoning_parser_cls is None:
            return ("enable_thinking",)
        return REASONING_FORMATS[self.reasoning_parser_cls.name].thinking_kwargs

    def _reasoning_parser(self, request: ChatCompletionRequest) -> ReasoningParser | None:
        if self.reasoning_parser_cls is None:
            return None
        return self.reasoning_parser_cls.for_request(request.chat_template_kwargs)

    # ---- checks -----------------------------------------------------------------------

    def _check_unsupported(self, request: ChatCompletionRequest) -> None:
        # Never silently ignore what would change the answer's shape.
        choice = request.tool_choice
        if choice is not None and not request.tools and choice != "none":
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if request.tools:
            for i, tool in enumerate(request.tools):
                function = tool.get("function") if isinstance(tool, dict) else None
                if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                        or not isinstance(function.get("name"), str):
                    raise OpenAIError("each tool must be {\"type\": \"function\", \"function\": "
                                      "{\"name\": ..., \"parameters\": {...}}}", param=f"tools[{i}]")
            if isinstance(choice, dict):
                named_function(request.tools, choice)  # 400 unless it names one of the tools
            elif choice not in (None, "auto", "none", "required"):
                raise OpenAIError("tool_choice must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  param="tool_choice")
            if choice in (None, "auto") and not (self.enable_auto_tool_choice and self.tool_parser_cls):
                raise OpenAIError("tool_choice \"auto\" needs the server started with "
                                  "--enable-auto-tool-choice and --tool-call-parser", param="tools")
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        check_stream_options(request)

    @staticmethod
    def _error_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
        # SamplingParams says "max_tokens"/"logprobs"; the client may have sent the chat
        # names for them.
        aliases = {"logprobs": "top_logprobs", "prompt": "messages",
                   "prompt_token_ids": "messages"}
        if request.max_completion_tokens is not None:
            aliases["max_tokens"] = "max_completion_tokens"
        return {"known_params": _REQUEST_FIELDS | SAMPLING_PARAM_NAMES, "aliases": aliases}

    # ---- request -> engine inputs -------------------------------------------------------

    @property
    def _image_processor(self) -> Any:
        """A vision-language model's prompt processor; None for a text model (and for the
        stand-in engines of tests)."""
        return getattr(getattr(self.engine, "preparer", None), "image_processor", None)

    def _render(self, request: ChatCompletionRequest) -> tuple[RenderedChat, list[int]]:
        """The chat template's text (one image placeholder per image part, on a model that
        takes images) and its token ids (placeholders not yet expanded)."""
        processor = self._image_processor
        try:
            rendered = render_chat(
                self.tokenizer, request.messages,
                chat_template=request.chat_template or self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools or None, chat_template_kwargs=request.chat_template_kwargs,
                image_placeholder=None if processor is None else processor.chat_placeholder,
                max_images=None if processor is None else processor.max_images)
        except ValueError as exc:
            no_template = "no chat template" in str(exc)
            raise to_openai_error(exc, known_params=_REQUEST_FIELDS,
                                  default_param="chat_template" if no_template
                                  else "messages") from exc
        # The template already spells out BOS etc.; do not add them twice.
        try:
            ids = encode_prompt(self.tokenizer, rendered.text, self.engine.max_model_len,
                                add_special_tokens=False,
                                truncating=request.truncate_prompt_tokens is not None)
        except ValueError as exc:
            raise OpenAIError(str(exc).replace("prompt", "messages", 1), param="messages",
                              code="context_length_exceeded") from exc
        return rendered, ids

    def _build_params(self, request: ChatCompletionRequest, prompt_len: int,
                      ctx: ConstraintContext) -> SamplingParams:
        requested = request.max_completion_tokens
        param = "max_completion_tokens"
        if requested is None:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = resolve_max_tokens(requested, prompt_len, self.engine.max_model_len,
                                        param=param, prompt_kind="messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return build_sampling_params(request, self.engine.default_sampling_params(),
                                     max_tokens=max_tokens, logprobs=logprobs,
                                     prompt_logprobs=request.prompt_logprobs,
                                     stream=bool(request.stream),
                                     aliases=self._error_kwargs(request)["aliases"],
                                     structured_outputs=self._constraint(request, ctx))

    def _prepare(self, request: ChatCompletionRequest, ctx: ConstraintContext
                 ) -> tuple[str, list[int], SamplingParams]:
        """Template, tokenize, truncate, build the SamplingParams (on the preprocessing
        thread: this is the part whose cost grows with the request). Text only: the
        Responses route, whose translation refuses image items."""
        rendered, token_ids = self._render(request)
        if rendered.images:
            raise OpenAIError("images are taken by /v1/chat/completions", param="messages")
        prompt, token_ids, params = self._finish_prompt(request, ctx, rendered.text,
                                                        token_ids, None)
        return prompt["prompt"], token_ids, params

    def _finish_prompt(self, request: ChatCompletionRequest, ctx: ConstraintContext,
                       text: str, token_ids: list[int], images: list | None
                       ) -> tuple[dict, list[int], SamplingParams]:
        """The engine's prompt, its token ids (each image's placeholder expanded to the
        image's tokens, so max_tokens and usage count them) and the SamplingParams."""
        prompt: dict = {"prompt": text}
        if images:
            if request.truncate_prompt_tokens is not None:
                raise OpenAIError("truncate_prompt_tokens would cut images' tokens apart; it "
                                  "is not taken with images", param="truncate_prompt_tokens")
            try:
                token_ids, _ = self._image_processor.process_tokens(
                    token_ids, images)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="messages") from exc
            if len(token_ids) >= self.engine.max_model_len:
                raise OpenAIError(f"the messages' {len(token_ids)} tokens (images' included) "
                                  f"leave no room for output in the {self.engine.max_model_len} "
                                  "of this model's context", param="messages",
                                  code="context_length_exceeded")
            prompt["multi_modal_data"] = {"image": images}
        else:
            truncated = truncate_prompt(token_ids, request.truncate_prompt_tokens,
                                        self.engine.max_model_len)
            if len(truncated) != len(token_ids):
                token_ids, prompt["prompt"] = truncated, self.tokenizer.decode(truncated)
        prompt["prompt_token_ids"] = token_ids
        return prompt, token_ids, self._build_params(request, len(token_ids), ctx)

    async def _engine_prompt(self, request: ChatCompletionRequest, ctx: ConstraintContext
                             ) -> tuple[dict, list[int], SamplingParams]:
        """The engine's prompt, its token ids and the SamplingParams: rendered on the
        preprocessing thread, its images fetched on the event loop, then expanded."""
        rendered, token_ids = await self.run_blocking(self._render, request)
        images = await self._load_images(rendered.images) if rendered.images else None
        return await self.run_blocking(self._finish_prompt, request, ctx, rendered.text,
                                       token_ids, images)

    async def _load_images(self, refs: list) -> list:
        """The images a chat names, fetched off the event loop's critical path (aiohttp,
        decoding on a thread) under the server's media rules; a 400 naming the reason for
        a refused URL."""
        if self._media is None:
            from folio.multimodal.media_fetch import MediaFetcher
            config = getattr(self.engine, "config", None)
            self._media = (MediaFetcher(config.multimodal.media) if config is not None
                           else MediaFetcher())
        try:
            return await self._media.load_images(refs)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    # ---- handler ----------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest, *, request_id: str,
                                     is_disconnected: IsDisconnected | None = None
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A ChatCompletionResponse, or (stream=true) an async iterator of SSE strings.
        Raises OpenAIError for anything wrong before the first byte."""
        model_name, lora_request = await self.resolve_model(request.model)
        self._check_unsupported(request)
        response_id = with_prefix("chatcmpl-", request.request_id or request_id)
        check_constraint_sizes(request, self.limits)
        ctx = constraint_context(self.engine)
        prompt, token_ids, params = await self._engine_prompt(request, ctx)
        error_kwargs = self._error_kwargs(request)
        created = int(time.time())
        streams = self.start_streams([prompt], [params], [response_id], request,
                                     is_disconnected, lora_request)
        if request.stream:
            first = await self.first_output(streams, error_kwargs)
            return self._stream(request, response_id, model_name, created, token_ids, params,
                                streams, first, error_kwargs)
        [output] = await self.collect_final(streams, 1, error_kwargs)
        # Detokenizing n choices' logprobs can take a while: off the event loop too.
        response = await self.run_blocking(self._response, request, response_id, model_name,
                                           created, token_ids, output)
        response.structured_outputs_notice = ctx.notice
        return response

    # ---- output formatting ------------------------------------------------------------

    def _logprobs(self, request: ChatCompletionRequest, completion: CompletionOutput
                  ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, self.tokenizer,
                             num_top=request.top_logprobs or 0)

    def _response(self, request: ChatCompletionRequest, response_id: str, model_name: str,
                  created: int, prompt_ids: list[int], output: RequestOutput
                  ) -> ChatCompletionResponse:
        choices = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            reasoning, content = None, completion.text
            parser = self._reasoning_parser(request)
            if parser is not None:
                reasoning, content = parser.extract(completion.text)
            tool_calls = None
            finish_reason = completion.finish_reason
            tool_parser = self._tool_parser(request)
            if tool_parser is not None and content:
                extracted = tool_parser.extract(content)
                if extracted.tools_called:
                    content = extracted.content
                    calls = extracted.tool_calls
                    if request.parallel_tool_calls is False:
                        calls = calls[:1]  # the client asked for one call at most
                    tool_calls = [ToolCallItem(id=c.id, function=FunctionCall(
                        name=c.name, arguments=c.arguments)) for c in calls]
                    if finish_reason == "stop" and not isinstance(request.tool_choice, dict):
                        # OpenAI: a named (forced) function ends with "stop".
                        finish_reason = "tool_calls"
            choices.append(ChatCompletionResponseChoice(
                index=completion.index,
                message=ChatMessage(role="assistant", content=content, tool_calls=tool_calls,
                                    reasoning_content=reasoning, reasoning=reasoning),
                logprobs=self._logprobs(request, completion),
                finish_reason=finish_reason, stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if request.return_token_ids else None))
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=response_id, created=created, model=model_name, choices=choices,
            usage=make_usage(len(prompt_ids), completion_tokens, output.num_cached_tokens),
            prompt_logprobs=(prompt_logprobs_json(output.prompt_logprobs)
                             if request.prompt_logprobs is not None else None),
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
            kv_transfer_params=output.kv_transfer_params)

    async def _stream(self, request: ChatCompletionRequest, response_id: str, model_name: str,
                      created: int, prompt_ids: list[int], params: SamplingParams,
                      streams: EngineStreams, first: tuple[int, RequestOutput] | None,
                      error_kwargs: dict[str, Any]) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
        prompt_tokens = len(prompt_ids)
        completion_tokens = cached = 0

        def chunk(choice: ChatCompletionResponseStreamChoice | None, *,
                  prompt_token_ids: list[int] | None = None, final_usage: bool = False) -> str:
            usage = None
            if continuous_usage or final_usage:
                usage = make_usage(prompt_tokens, completion_tokens, cached)
            return sse_event(ChatCompletionStreamResponse(
                id=response_id, created=created, model=model_name,
                choices=[choice] if choice is not None else [], usage=usage,
                prompt_token_ids=prompt_token_ids))

        parsers = {i: self._reasoning_parser(request) for i in range(params.n)}
        tool_parsers = {i: self._tool_parser(request) for i in range(params.n)}
        called_tools: set[int] = set()

        def split_tools(index: int, content: str | None, final: bool
                        ) -> tuple[str | None, list[DeltaToolCall] | None]:
            tool_parser = tool_parsers.get(index)
            if tool_parser is None:
                return content, None
            text, calls = "", []
            for piece in tool_parser.stream_pieces(content, final):
                text += piece.content or ""
                calls += [DeltaToolCall(
                    index=c.index, id=c.id, type="function" if c.id else None,
                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                    for c in piece.tool_calls
                    # parallel_tool_calls=false: only the first call is passed on.
                    if c.index == 0 or request.parallel_tool_calls is not False]
            if calls:
                called_tools.add(index)
            return text or None, calls or None

        def delta(index: int, text: str, *, final: bool = False) -> DeltaMessage | None:
            """The text delta split into reasoning, content and tool-call deltas; None when
            nothing shows yet (a parser may hold back a possible tag)."""
            reasoning, content = split_reasoning(parsers.get(index), text, final)
            content, tool_calls = split_tools(index, content, final)
            if reasoning is None and content is None and tool_calls is None:
                return None
            return DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                tool_calls=tool_calls)

        try:
            # The role comes first for every choice, as OpenAI sends it.
            for index in range(params.n):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content="")),
                    prompt_token_ids=(prompt_ids if request.return_token_ids and index == 0
                                      else None))
            async for _, output in self.iterate_stream(streams, first):
                cached = output.num_cached_tokens
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    # Tokens held back (e.g. a possible stop string) still carry logprobs
                    # or ids the client asked for.
                    wants_tokens = bool(request.logprobs or request.return_token_ids)
                    message = delta(completion.index, completion.text,
                                    final=completion.finish_reason is not None)
                    if message is not None or (completion.token_ids and wants_tokens):
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=completion.index, delta=message or DeltaMessage(content=""),
                            logprobs=self._logprobs(request, completion),
                            token_ids=(list(completion.token_ids) if request.return_token_ids
                                       else None)))
                    if completion.finish_reason is not None:
                        finish_reason = completion.finish_reason
                        if finish_reason == "stop" and completion.index in called_tools \
                                and not isinstance(request.tool_choice, dict):
                            finish_reason = "tool_calls"
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=completion.index, delta=DeltaMessage(),
                            finish_reason=finish_reason,
                            stop_reason=completion.stop_reason))
            if include_usage:
                yield chunk(None, final_usage=True)
        except Exception as exc:  # after the first byte errors can only travel in-stream
            yield sse_error(to_openai_error(exc, **error_kwargs))
        finally:
            await streams.aclose()
        yield SSE_DONE
