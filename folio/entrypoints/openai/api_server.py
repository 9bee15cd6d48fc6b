"""The OpenAI-compatible HTTP server: routes, auth, errors, metrics, and `folio serve`.

The app owns no model: requests go to an AsyncLLM (engine core in its own process). Every
error leaves as OpenAI's error body; the engine and the other requests go on.
"""
from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import folio
from folio.engine.async_llm import AsyncLLM
from folio.engine.request_limits import json_depth_exceeds
from folio.engine.input_processor import encode_prompt
from folio.entrypoints.openai.anthropic_protocol import CountTokensRequest, MessagesRequest
from folio.entrypoints.openai.anthropic_responses import error_status_and_body
from folio.entrypoints.openai.errors import OpenAIError, validation_error_to_openai
from folio.entrypoints.openai.pooling_protocol import (ClassificationRequest, EmbeddingRequest,
                                                       PoolingRequest, RerankRequest,
                                                       ScoreRequest)
from folio.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, LoadLoRAAdapterRequest,
                                               TokenizeRequest, UnloadLoRAAdapterRequest)
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES as _DEFAULT_MAX_BODY_BYTES
from folio.entrypoints.openai.cli_args import build_engine_config
from folio.entrypoints.openai.console_auth import CHALLENGE, basic_auth_matches, wants_challenge
from folio.entrypoints.openai.serving_classify import OpenAIServingClassification
from folio.entrypoints.openai.serving_completion import OpenAIServingCompletion
from folio.entrypoints.openai.serving_messages import AnthropicServingMessages
from folio.entrypoints.openai.responses_protocol import ResponsesRequest
from folio.entrypoints.openai.responses_routes import add_responses_routes
from folio.entrypoints.openai.responses_store import ResponsesConfig
from folio.entrypoints.openai.serving_responses import OpenAIServingResponses
from folio.entrypoints.openai.serving_embedding import (OpenAIServingEmbedding,
                                                        OpenAIServingPooling)
from folio.entrypoints.openai.serving_models import OpenAIServingModels
from folio.entrypoints.openai.serving_score import OpenAIServingScore

logger = logging.getLogger("folio.server")

# Routes a load balancer or orchestrator must reach without credentials.
_OPEN_ROUTES = {"/health", "/ping", "/version"}


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    allowed_origins: list[str] = field(default_factory=list)
    max_request_body_bytes: int = _DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = 128
    # A request's own chat_template is Jinja run in the server: refused unless trusted.
    trust_request_chat_template: bool = False
    # The web console at / (console_routes.py); --disable-console turns it off.
    enable_console: bool = True
    # /v1/responses: its store's bounds and file, its background runs.
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    if error.headers:
        headers = {**error.headers, **(headers or {})}
    return JSONResponse(error.to_response_body(), status_code=error.status_code, headers=headers)


def _anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def route_error_response(path: str, error: OpenAIError,
                         headers: dict[str, str] | None = None) -> JSONResponse:
    """The error in OpenAI's body, or in Anthropic's on Anthropic's routes (/v1/messages...):
    its clients read only their own shape."""
    if not _anthropic_route(path):
        return error_response(error, headers)
    if error.headers:
        headers = {**error.headers, **(headers or {})}
    status, body = error_status_and_body(error.status_code, error.message)
    return JSONResponse(body, status_code=status, headers=headers)


def api_key_matches(headers: Any, api_key: str) -> bool:
    """`Authorization: Bearer <key>` (OpenAI's clients), `x-api-key: <key>` (Anthropic's), or
    HTTP Basic with the key as the password (a browser on the web console)."""
    bearer = headers.get("authorization", "")
    if hmac.compare_digest(bearer.encode(), f"Bearer {api_key}".encode()):
        return True
    x_api_key = headers.get("x-api-key")
    if x_api_key is not None and hmac.compare_digest(x_api_key.encode(), api_key.encode()):
        return True
    return basic_auth_matches(headers, api_key)


async def _read_json(request: Request, limit: int, max_depth: int) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise OpenAIError(f"request body is larger than {limit} bytes", status_code=413)
    if not body:
        raise OpenAIError("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except RecursionError:
        raise OpenAIError(f"request body nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of > 4,300 digits
        raise OpenAIError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    # Fewer brackets than the limit cannot nest past it: the walk is skipped for most bodies.
    if body.count(b"[") + body.count(b"{") > max_depth and json_depth_exceeds(data, max_depth):
        raise OpenAIError(f"request body nests deeper than {max_depth} levels")
    return data


def _parse(model: type[pydantic.BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error_to_openai(exc) from exc


def build_app(engine: AsyncLLM, settings: ServerSettings, metrics: Any | None = None) -> FastAPI:
    """The app; a ValueError for settings it cannot serve (a bad --lora-modules adapter)."""
    started = int(time.time())
    models = OpenAIServingModels(engine, settings.served_model_names, created=started)
    models.add_static_adapters()
    completions = OpenAIServingCompletion(engine, settings.served_model_names,
                                          default_chat_template=settings.chat_template,
                                          models=models)
    tool_call_parser = settings.tool_call_parser
    if tool_call_parser == "auto":
        from folio.entrypoints.openai.tool_parsers import detect_tool_parser
        template = settings.chat_template or getattr(engine.tokenizer, "chat_template", None) or ""
        tool_call_parser = detect_tool_parser(template)
        if tool_call_parser is None:
            raise ValueError("--tool-call-parser auto: the chat template shows no known tool-call "
                             "format; name the parser")
        logger.info("tool-call parser picked from the chat template: %s", tool_call_parser)
    if settings.enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    chat_options = dict(chat_template=settings.chat_template,
                        reasoning_parser=settings.reasoning_parser,
                        tool_call_parser=tool_call_parser,
                        enable_auto_tool_choice=settings.enable_auto_tool_choice, models=models)
    chat = OpenAIServingChat(engine, settings.served_model_names, **chat_options)
    # Anthropic's Messages API: the chat handler's machinery with Anthropic's shapes.
    anthropic_messages = AnthropicServingMessages(engine, settings.served_model_names,
                                                  **chat_options)
    names = settings.served_model_names
    embeddings = OpenAIServingEmbedding(engine, names)
    pooling = OpenAIServingPooling(engine, names)
    classification = OpenAIServingClassification(engine, names)
    scores = OpenAIServingScore(engine, names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="folio", version=folio.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics

    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Auth first (every route but health checks), then size limit, request id echo."""
        request_id = request.headers.get("x-request-id")
        headers = {"X-Request-Id": request_id} if request_id else None
        if settings.api_key is not None and request.url.path not in _OPEN_ROUTES \
                and request.method != "OPTIONS":
            if not api_key_matches(request.headers, settings.api_key):
                if settings.enable_console and wants_challenge(request.url.path):
                    headers = {**(headers or {}), **CHALLENGE}  # the browser asks for the key
                return route_error_response(request.url.path, OpenAIError(
                    "invalid or missing API key", status_code=401, type="AuthenticationError"),
                    headers)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_body_bytes:
            return route_error_response(request.url.path, OpenAIError(
                f"request body is larger than {settings.max_request_body_bytes} bytes",
                status_code=413), headers)
        response = await call_next(request)
        if request_id:
            response.headers["X-Request-Id"] = request_id
        return response

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return route_error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return route_error_response(request.url.path, OpenAIError(
            str(exc.detail), status_code=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return route_error_response(request.url.path, OpenAIError(
            f"internal error: {type(exc).__name__}", status_code=500, type="InternalServerError"))

    def _request_id(request: Request, prefix: str) -> str:
        given = request.headers.get("x-request-id")
        return f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"

    def _respond(result: Any) -> Response:
        if isinstance(result, pydantic.BaseModel):
            return JSONResponse(result.model_dump(exclude_none=False))
        # Streaming: SSE strings from the handler.
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _unavailable() -> OpenAIError:
        reason = getattr(engine, "unavailable_reason", None) or engine.errored or "shut down"
        return OpenAIError(f"the engine is not available: {reason}", status_code=503,
                           type="ServiceUnavailableError")

    def _check_engine() -> None:
        if not engine.is_healthy:
            raise _unavailable()

    def _check_template(data: dict) -> None:
        if data.get("chat_template") is not None and not settings.trust_request_chat_template:
            raise OpenAIError("a request's own chat_template is refused unless the server runs "
                              "with --trust-request-chat-template", param="chat_template")

    async def _body(request: Request) -> dict:
        return await _read_json(request, settings.max_request_body_bytes, settings.max_json_depth)

    def _check_generate_model(route: str) -> None:
        if engine.model_info.pooling is not None:
            raise OpenAIError(f"{route} needs a model that generates text, and this one runs "
                              "the pooling runner: it serves /v1/embeddings, /pooling, "
                              "/classify, /score and /rerank", param="model")

    async def _completion(data: dict, request: Request) -> Response:
        _check_engine()
        _check_generate_model("/v1/completions")
        parsed = _parse(CompletionRequest, data)
        return _respond(await completions.create_completion(
            parsed, request_id=_request_id(request, "cmpl"), is_disconnected=request.is_disconnected))

    async def _chat(data: dict, request: Request) -> Response:
        _check_engine()
        _check_generate_model("/v1/chat/completions")
        _check_template(data)
        parsed = _parse(ChatCompletionRequest, data)
        return _respond(await chat.create_chat_completion(
            parsed, request_id=_request_id(request, "chatcmpl"), is_disconnected=request.is_disconnected))

    @app.post("/v1/completions", openapi_extra=_json_body("CompletionRequest"))
    async def create_completion(request: Request):
        return await _completion(await _body(request), request)

    @app.post("/v1/chat/completions", openapi_extra=_json_body("ChatCompletionRequest"))
    async def create_chat_completion(request: Request):
        return await _chat(await _body(request), request)

    @app.post("/invocations", openapi_extra=_json_body(
        "ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest",
        "ClassificationRequest", "ScoreRequest", "RerankRequest"))
    async def invocations(request: Request):
        """SageMaker-style: one route, dispatched on the body's shape: chat (`messages`),
        completions (`prompt`), and for a pooling model embeddings or classification
        (`input`, by the model's kind), rerank (`query` + `documents`), score (`text_1` or
        `queries`)."""
        data = await _body(request)
        if "messages" in data:
            return await _chat(data, request)
        if "prompt" in data:
            return await _completion(data, request)
        info = engine.model_info.pooling
        if info is not None:
            if "input" in data:
                if info.kind == "embed":
                    return await _pooling_body(data, request, EmbeddingRequest, "embd",
                                               embeddings.create_embedding)
                return await _pooling_body(data, request, ClassificationRequest, "classify",
                                           classification.create_classify)
            if "query" in data and "documents" in data:
                return await _pooling_body(data, request, RerankRequest, "rerank",
                                           scores.create_rerank)
            if "text_1" in data or "queries" in data:
                return await _pooling_body(data, request, ScoreRequest, "score",
                                           scores.create_score)
            raise OpenAIError("invocations body needs 'input' (embeddings / classification), "
                              "'query' and 'documents' (rerank) or 'text_1' / 'queries' "
                              "(score) for this pooling model")
        raise OpenAIError("invocations body needs 'messages' (chat) or 'prompt' (completions)")

    async def _pooling(request: Request, model: type[pydantic.BaseModel], prefix: str,
                       handler: Callable[..., Awaitable[dict]]) -> Response:
        """A pooling route: its body parsed, the handler's response dict rendered off the
        event loop (thousands of embeddings are megabytes of JSON)."""
        return await _pooling_body(await _body(request), request, model, prefix, handler)

    async def _pooling_body(data: dict, request: Request, model: type[pydantic.BaseModel],
                            prefix: str, handler: Callable[..., Awaitable[dict]]) -> Response:
        _check_engine()
        parsed = _parse(model, data)
        body = await handler(parsed, request_id=_request_id(request, prefix),
                             is_disconnected=request.is_disconnected)
        return await engine.run_blocking(JSONResponse, body)

    @app.post("/v1/embeddings", openapi_extra=_json_body("EmbeddingRequest"))
    async def create_embedding(request: Request):
        return await _pooling(request, EmbeddingRequest, "embd", embeddings.create_embedding)

    @app.post("/pooling", openapi_extra=_json_body("PoolingRequest"))
    async def create_pooling(request: Request):
        return await _pooling(request, PoolingRequest, "pool", pooling.create_pooling)

    @app.post("/classify", openapi_extra=_json_body("ClassificationRequest"))
    async def create_classify(request: Request):
        return await _pooling(request, ClassificationRequest, "classify",
                              classification.create_classify)

    @app.post("/score", openapi_extra=_json_body("ScoreRequest"))
    @app.post("/v1/score", openapi_extra=_json_body("ScoreRequest"))
    async def create_score(request: Request):
        return await _pooling(request, ScoreRequest, "score", scores.create_score)

    @app.post("/rerank", openapi_extra=_json_body("RerankRequest"))
    @app.post("/v1/rerank", openapi_extra=_json_body("RerankRequest"))
    @app.post("/v2/rerank", openapi_extra=_json_body("RerankRequest"))
    async def create_rerank(request: Request):
        return await _pooling(request, RerankRequest, "rerank", scores.create_rerank)

    @app.post("/v1/messages", openapi_extra=_json_body("MessagesRequest"))
    async def create_message(request: Request):
        """Anthropic's Messages API (the `anthropic-version` header is accepted, not needed)."""
        _check_engine()
        _check_generate_model("/v1/messages")
        parsed = _parse(MessagesRequest, await _body(request))
        result = await anthropic_messages.create_message(
            parsed, request_id=_request_id(request, "msg"),
            is_disconnected=request.is_disconnected)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/messages/count_tokens", openapi_extra=_json_body("CountTokensRequest"))
    async def count_message_tokens(request: Request):
        _check_generate_model("/v1/messages/count_tokens")
        parsed = _parse(CountTokensRequest, await _body(request))
        return await anthropic_messages.count_tokens(parsed)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.model_cards()}

    openapi_models: list[type[pydantic.BaseModel]] = []
    if models.runtime_updating:
        # Only with --allow-runtime-lora-updating: otherwise the routes do not exist (404),
        # as in vLLM. The API key guards them like every other route.
        _add_lora_routes(app, models, _body)
        openapi_models = [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]
    model_config = getattr(getattr(engine, "config", None), "model", None)
    if getattr(model_config, "enable_sleep_mode", False):
        _add_sleep_routes(app, engine)

    def _bounded_encode(text: str, param: str, *, add_special_tokens: bool) -> list[int]:
        # A text far past the context is refused without tokenizing all of it (as the
        # generation routes do): tokenizing 30 MB would hold the preprocessing thread ~40 s.
        try:
            return encode_prompt(engine.tokenizer, text, engine.max_model_len,
                                 add_special_tokens=add_special_tokens)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from exc

    def _tokenize(data: TokenizeRequest) -> dict:
        tokenizer = engine.tokenizer
        if data.messages is not None:
            from folio.engine.chat import apply_chat_template
            try:
                text = apply_chat_template(
                    tokenizer, data.messages,
                    chat_template=data.chat_template or settings.chat_template,
                    add_generation_prompt=data.add_generation_prompt,
                    continue_final_message=data.continue_final_message,
                    chat_template_kwargs=data.chat_template_kwargs)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="messages") from exc
            ids = _bounded_encode(text, "messages", add_special_tokens=False)
        elif isinstance(data.prompt, str):
            ids = _bounded_encode(data.prompt, "prompt",
                                  add_special_tokens=data.add_special_tokens)
        else:
            raise OpenAIError("tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if data.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/tokenize", openapi_extra=_json_body("TokenizeRequest"))
    async def tokenize(request: Request):
        data = await _body(request)
        _check_template(data)
        return await engine.run_blocking(_tokenize, _parse(TokenizeRequest, data))

    @app.post("/detokenize", openapi_extra=_json_body("DetokenizeRequest"))
    async def detokenize(request: Request):
        data = _parse(DetokenizeRequest, await _body(request))
        vocab = engine.model_info.vocab_size
        if not all(0 <= t < vocab for t in data.tokens):
            raise OpenAIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": await engine.run_blocking(engine.tokenizer.decode, data.tokens)}

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return error_response(_unavailable())
        return Response(status_code=200)

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": folio.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise OpenAIError("metrics are disabled", status_code=404, type="NotFoundError")
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    if settings.enable_console:
        from folio.entrypoints.openai.console_routes import add_console_routes
        add_console_routes(app, engine, metrics)

    def _check_responses_ready() -> None:
        _check_engine()
        _check_generate_model("/v1/responses")

    add_responses_routes(app, OpenAIServingResponses(engine, names, config=settings.responses,
                                                     **chat_options),
                         read_body=_body, check_ready=_check_responses_ready,
                         openapi_extra=_json_body("ResponsesRequest"))

    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                           DetokenizeRequest, EmbeddingRequest, PoolingRequest,
                           ClassificationRequest, ScoreRequest, RerankRequest,
                           MessagesRequest, CountTokensRequest, ResponsesRequest,
                           *openapi_models])
    return app


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels,
                     read_body: Callable[[Request], Awaitable[dict]]) -> None:
    """vLLM's run-time adapter routes: plain-text success, OpenAI error bodies otherwise."""

    @app.post("/v1/load_lora_adapter", openapi_extra=_json_body("LoadLoRAAdapterRequest"))
    async def load_lora_adapter(request: Request):
        body = _parse(LoadLoRAAdapterRequest, await read_body(request))
        return Response(await models.load_lora_adapter(body), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_json_body("UnloadLoRAAdapterRequest"))
    async def unload_lora_adapter(request: Request):
        body = _parse(UnloadLoRAAdapterRequest, await read_body(request))
        return Response(await models.unload_lora_adapter(body), media_type="text/plain")


def _add_sleep_routes(app: FastAPI, engine: Any) -> None:
    """vLLM's sleep mode routes (only with --enable-sleep-mode; behind the API key)."""

    async def call(method: str, *args: Any) -> Any:
        try:
            return await getattr(engine, method)(*args)
        except RuntimeError as exc:
            # the engine core's refusal (busy, asleep already, bad level) comes back as text
            message = str(exc)
            if message.startswith("ValueError: "):
                raise OpenAIError(message.removeprefix("ValueError: ")) from exc
            raise

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level not in (1, 2):
            raise OpenAIError(f"level must be 1 or 2, got {level}", param="level")
        freed = await call("sleep", level)
        return JSONResponse({"is_sleeping": True, "level": level, "freed_bytes": freed})

    @app.post("/wake_up")
    async def wake_up(request: Request):
        tags = request.query_params.getlist("tags") or None
        await call("wake_up", tags)
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await engine.is_sleeping()}


def _json_body(*models: str) -> dict:
    """The OpenAPI requestBody of a route that reads its JSON itself (to bound its size and
    depth first): clients and fuzzers see the real request schema."""
    refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _install_openapi(app: FastAPI, models: list[type[pydantic.BaseModel]]) -> None:
    """/openapi.json with the request models (and their nested types) as components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- `folio serve` ----------------------------------------------------------------------

def _load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value  # the template itself
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a shutdown signal first ends every open request with a clean
        error (503, or an error event in the stream), so the graceful phase has nothing to
        wait for and the process is gone within seconds whatever is in flight."""

        engine: AsyncLLM | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own version re-raises the signal after shutting down, which kills the
            # process before `serve`'s cleanup runs; a clean shutdown here exits with 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.engine is not None and not self.should_exit:
                logger.info("shutting down (signal %d): aborting %d open request(s)", sig,
                            self.engine.num_open_requests)
                self.engine.begin_shutdown("the server is shutting down")
            super().handle_exit(sig, frame)

    return Server


def _check_lora_flags(args: argparse.Namespace, lora: Any) -> None:
    """The server's LoRA flags mean nothing with LoRA off: say so rather than ignore them."""
    if lora is None:
        given = [flag for flag, value in (
            ("--allow-runtime-lora-updating", getattr(args, "allow_runtime_lora_updating", False)),
            ("--allowed-lora-dir", getattr(args, "allowed_lora_dirs", None)),
            ("--lora-resolver-dir", getattr(args, "lora_resolver_dir", None))) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: LoRA is off; add --enable-lora "
                             "(or --lora-modules)")
        return
    if lora.lora_resolver_dir is not None and not os.path.isdir(lora.lora_resolver_dir):
        raise ValueError(f"--lora-resolver-dir {lora.lora_resolver_dir}: no such directory")
    if lora.allow_runtime_lora_updating and not lora.allowed_lora_dirs:
        logger.warning("--allow-runtime-lora-updating without --allowed-lora-dir: "
                       "/v1/load_lora_adapter will refuse every path")


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    started = time.perf_counter()
    from folio.model.default_model import DEFAULT_MODEL_NAME
    config = build_engine_config(args)
    _check_lora_flags(args, config.lora)
    if config.admission.sleep_mode_requests != "wait" and not config.model.enable_sleep_mode:
        raise ValueError("--sleep-mode-requests: the engine never sleeps without "
                         "--enable-sleep-mode")
    responses = ResponsesConfig.from_args(args)  # its flags refused before the engine starts
    chat_template = _load_chat_template(args.chat_template)
    model_arg = config.model.model
    names = args.served_model_name or [model_arg or DEFAULT_MODEL_NAME]
    metrics = None
    logger.info("folio %s: starting the engine for %s", folio.__version__, names[0])
    if config.parallel.data_parallel_size > 1:
        from folio.engine.dp_async_llm import DataParallelAsyncLLM
        engine = DataParallelAsyncLLM(config, log_stats=not args.disable_log_stats)
    else:
        engine = AsyncLLM(config, log_stats=not args.disable_log_stats)
    try:
        if not args.disable_log_stats:
            from folio.metrics import EngineMetrics
            metrics = EngineMetrics(names[0], engine.max_model_len,
                                    max_lora=config.lora.max_loras if config.lora else 0,
                                    cache_info=config.cache.metrics_info())
            metrics.track_api_requests(engine.num_tracked_requests)
            engine.metrics = metrics
        ready = engine.ready
        logger.info("KV cache: %d blocks x %d = %d tokens | max_model_len %d",
                    ready.num_blocks, ready.block_size, ready.num_blocks * ready.block_size,
                    engine.max_model_len)
        settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                                  chat_template=chat_template, allowed_origins=args.allowed_origins,
                                  reasoning_parser=args.reasoning_parser,
                                  tool_call_parser=args.tool_call_parser,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  max_request_body_bytes=args.max_request_body_bytes,
                                  max_json_depth=config.limits.max_json_depth,
                                  trust_request_chat_template=args.trust_request_chat_template,
                                  enable_console=not getattr(args, "disable_console", False),
                                  responses=responses)
        app = build_app(engine, settings, metrics)
        server_cls = _server_class()
        server = server_cls(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=5))
        server.engine = engine
        logger.info("serving %s (%s) on http://%s:%d%s | ready %.1f s after the command "
                    "started", names[0], engine.model_info.source.path, args.host, args.port,
                    " | API key required" if args.api_key else "",
                    time.perf_counter() - started)
        # On SIGINT/SIGTERM uvicorn stops accepting; open requests were just failed by
        # handle_exit; then the lifespan shuts the engine core down (bounded, ~5 s at most).
        server.run()
    finally:
        engine.shutdown()
    return 0
