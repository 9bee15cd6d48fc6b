"""The Responses API's routes: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items. The server's guard
(API key, body size) covers them as every other route; errors are OpenAI's bodies."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from folio.entrypoints.openai.errors import OpenAIError, validation_error_to_openai
from folio.entrypoints.openai.responses_protocol import ResponsesRequest
from folio.entrypoints.openai.serving_responses import (DEFAULT_LIST_LIMIT,
                                                        OpenAIServingResponses)

RESPONSES_PATH = "/v1/responses"


def add_responses_routes(app: FastAPI, handler: OpenAIServingResponses, *,
                         read_body: Callable[[Request], Awaitable[dict]],
                         check_ready: Callable[[], None],
                         openapi_extra: dict[str, Any]) -> None:
    """`read_body`: the server's bounded JSON reader; `check_ready`: raises the server's
    OpenAIError when the engine cannot generate (unhealthy, a pooling model);
    `openapi_extra`: the create route's documented request body."""

    @app.post(RESPONSES_PATH, openapi_extra=openapi_extra)
    async def create_response(request: Request):
        check_ready()
        try:
            parsed = ResponsesRequest.model_validate(await read_body(request))
        except pydantic.ValidationError as exc:
            raise validation_error_to_openai(exc) from exc
        result = await handler.create_response(parsed, is_disconnected=request.is_disconnected)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        if request.query_params.get("stream", "false").lower() != "false":
            raise OpenAIError("stream=true is not supported when retrieving a response; poll "
                              "it, or create it with stream=true", param="stream")
        return JSONResponse(handler.retrieve(response_id))

    @app.delete(RESPONSES_PATH + "/{response_id}")
    async def delete_response(response_id: str):
        return JSONResponse(await handler.delete(response_id))

    @app.post(RESPONSES_PATH + "/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return JSONResponse(await handler.cancel(response_id))

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request):
        query = request.query_params
        limit = query.get("limit", str(DEFAULT_LIST_LIMIT))
        # ASCII digits, few of them: int() refuses other digits and very long numbers.
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 6):
            raise OpenAIError(f"limit must be an integer, got {limit!r}", param="limit")
        return JSONResponse(handler.input_items(response_id, after=query.get("after"),
                                                limit=int(limit),
                                                order=query.get("order", "desc")))
