"""Server-sent events framing of the streaming responses."""
from __future__ import annotations

import json

from pydantic import BaseModel

from folio.entrypoints.openai.errors import OpenAIError

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return f"data: {body}\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse_event(error.to_response_body())
