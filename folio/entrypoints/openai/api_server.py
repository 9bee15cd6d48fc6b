"""The OpenAI-compatible HTTP server: routes, auth, errors, metrics, and `folio serve`.

The app owns no model: requests go to an AsyncLLM (engine core in its own process). Every
error leaves as OpenAI's error body; the engine and the other requests go on.
"""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import folio
from folio.engine.async_llm import AsyncLLM, EngineDeadError
from folio.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from folio.entrypoints.openai.serving_chat import OpenAIServingChat
from folio.entrypoints.openai.serving_common import OpenAIError, validation_error_to_openai
from folio.entrypoints.openai.cli_args import DEFAULT_MAX_BODY_BYTES as _DEFAULT_MAX_BODY_BYTES
from folio.entrypoints.openai.cli_args import build_engine_config
from folio.entrypoints.openai.serving_completion import OpenAIServingCompletion

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


def error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.to_response_body(), status_code=error.status_code, headers=headers)


async def _read_json(request: Request, limit: int) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise OpenAIError(f"request body is larger than {limit} bytes", status_code=413)
    if not body:
        raise OpenAIError("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    return data


def _parse(model: type[pydantic.BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error_to_openai(exc) from exc


def build_app(engine: AsyncLLM, settings: ServerSettings, metrics: Any | None = None) -> FastAPI:
    completions = OpenAIServingCompletion(engine, settings.served_model_names,
                                          default_chat_template=settings.chat_template)
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
    chat = OpenAIServingChat(engine, settings.served_model_names, chat_template=settings.chat_template,
                             reasoning_parser=settings.reasoning_parser,
                             tool_call_parser=tool_call_parser,
                             enable_auto_tool_choice=settings.enable_auto_tool_choice)
    started = int(time.time())

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
            supplied = request.headers.get("authorization", "")
            expected = f"Bearer {settings.api_key}"
            if not hmac.compare_digest(supplied.encode(), expected.encode()):
                return error_response(OpenAIError("invalid or missing API key", status_code=401,
                                                  type="AuthenticationError"), headers)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_body_bytes:
            return error_response(OpenAIError(
                f"request body is larger than {settings.max_request_body_bytes} bytes",
                status_code=413), headers)
        response = await call_next(request)
        if request_id:
            response.headers["X-Request-Id"] = request_id
        return response

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(str(exc.detail), status_code=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}", status_code=500,
                                          type="InternalServerError"))

    def _request_id(request: Request, prefix: str) -> str:
        given = request.headers.get("x-request-id")
        return f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"

    def _respond(result: Any) -> Response:
        if isinstance(result, pydantic.BaseModel):
            return JSONResponse(result.model_dump(exclude_none=False))
        # Streaming: SSE strings from the handler.
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _check_engine() -> None:
        if not engine.is_healthy:
            raise OpenAIError(f"the engine is not running: {engine.errored or 'shut down'}",
                              status_code=500, type="InternalServerError")

    async def _completion(data: dict, request: Request) -> Response:
        _check_engine()
        parsed = _parse(CompletionRequest, data)
        return _respond(await completions.create_completion(
            parsed, request_id=_request_id(request, "cmpl"), is_disconnected=request.is_disconnected))

    async def _chat(data: dict, request: Request) -> Response:
        _check_engine()
        parsed = _parse(ChatCompletionRequest, data)
        return _respond(await chat.create_chat_completion(
            parsed, request_id=_request_id(request, "chatcmpl"), is_disconnected=request.is_disconnected))

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await _completion(await _read_json(request, settings.max_request_body_bytes), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await _chat(await _read_json(request, settings.max_request_body_bytes), request)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker-style: one route, dispatched on the body's shape."""
        data = await _read_json(request, settings.max_request_body_bytes)
        if "messages" in data:
            return await _chat(data, request)
        if "prompt" in data:
            return await _completion(data, request)
        raise OpenAIError("invocations body needs 'messages' (chat) or 'prompt' (completions)")

    @app.get("/v1/models")
    async def list_models():
        cards = [{"id": name, "object": "model", "created": started, "owned_by": "folio",
                  "root": engine.model_info.source.path, "parent": None,
                  "max_model_len": engine.max_model_len}
                 for name in settings.served_model_names]
        return {"object": "list", "data": cards}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        data = await _read_json(request, settings.max_request_body_bytes)
        tokenizer = engine.tokenizer
        if "messages" in data:
            from folio.engine.chat import apply_chat_template
            try:
                text = apply_chat_template(
                    tokenizer, data["messages"], chat_template=data.get("chat_template") or settings.chat_template,
                    add_generation_prompt=bool(data.get("add_generation_prompt", True)),
                    continue_final_message=bool(data.get("continue_final_message", False)),
                    chat_template_kwargs=data.get("chat_template_kwargs"))
            except ValueError as exc:
                raise OpenAIError(str(exc), param="messages") from exc
            ids = tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(data.get("prompt"), str):
            ids = tokenizer.encode(data["prompt"], add_special_tokens=bool(data.get("add_special_tokens", True)))
        else:
            raise OpenAIError("tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if data.get("return_token_strs"):
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        data = await _read_json(request, settings.max_request_body_bytes)
        tokens = data.get("tokens")
        vocab = engine.model_info.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < vocab for t in tokens):
            raise OpenAIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return error_response(OpenAIError(f"engine is not running: {engine.errored or 'shut down'}",
                                              status_code=500, type="InternalServerError"))
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

    return app


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


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    from folio.model.default_model import DEFAULT_MODEL_NAME
    config = build_engine_config(args)
    chat_template = _load_chat_template(args.chat_template)
    model_arg = config.model.model
    names = args.served_model_name or [model_arg or DEFAULT_MODEL_NAME]
    metrics = None
    engine = AsyncLLM(config)
    try:
        if not args.disable_log_stats:
            from folio.metrics import EngineMetrics
            metrics = EngineMetrics(names[0], engine.max_model_len)
            engine.metrics = metrics
        ready = engine.ready
        logger.info("folio %s serving %s (%s) | KV cache: %d blocks x %d = %d tokens | "
                       "max_model_len %d | http://%s:%d%s", folio.__version__, names[0],
                       engine.model_info.source.path, ready.num_blocks, ready.block_size,
                       ready.num_blocks * ready.block_size, engine.max_model_len, args.host,
                       args.port, " | API key required" if args.api_key else "")
        settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                                  chat_template=chat_template, allowed_origins=args.allowed_origins,
                                  reasoning_parser=args.reasoning_parser,
                                  tool_call_parser=args.tool_call_parser,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  max_request_body_bytes=args.max_request_body_bytes)
        app = build_app(engine, settings, metrics)
        # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight requests finish
        # (bounded by the graceful timeout), then the lifespan shuts the engine core down.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=10)
    finally:
        engine.shutdown()
    return 0
