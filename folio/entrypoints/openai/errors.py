"""OpenAI's error bodies: OpenAIError (the {"error": {...}} body and its status), and the
mapping of request-validation, SamplingParams and engine errors onto it, naming the request
field the client sent."""
from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

from folio.engine.admission import RequestRejected
from folio.engine.async_llm import EngineAsleep, EngineDeadError

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error the server returns as OpenAI's {"error": {...}} body with `status_code`."""

    def __init__(self, message: str, *, status_code: int = 400,
                 type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Response headers it needs (a 429's Retry-After).
        self.headers = headers
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
    if isinstance(exc, RequestRejected):
        # OpenAI's rate-limit shape; Retry-After from the measured drain rate
        return OpenAIError(str(exc), status_code=429, type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineAsleep):
        # Not a fault of the request or of the server (health stays 200): retry after the
        # wake-up (--sleep-mode-requests reject).
        return OpenAIError(str(exc), status_code=503, type="ServiceUnavailableError",
                           headers={"Retry-After": str(exc.retry_after)})
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
