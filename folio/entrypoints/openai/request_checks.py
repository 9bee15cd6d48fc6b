"""Bounds on the parts of an OpenAI request that feed a grammar compiler (response_format,
structured_outputs, tools), checked before any parser sees them, each a 400 naming the field
the client sent. The sampling fields' bounds are the engine's (folio.engine.request_limits):
they apply offline too."""
from __future__ import annotations

import json
from typing import Any

from folio.config import RequestLimitsConfig
from folio.engine.request_limits import json_depth_exceeds
from folio.entrypoints.openai.errors import OpenAIError


def _check_one(value: Any, param: str, limits: RequestLimitsConfig) -> None:
    if value is None:
        return
    if json_depth_exceeds(value, limits.max_schema_depth):
        raise OpenAIError(f"{param} nests deeper than {limits.max_schema_depth} levels "
                          f"(--max-schema-depth)", param=param)
    size = len(value.encode("utf-8", "replace")) if isinstance(value, str) else \
        len(json.dumps(value, ensure_ascii=False).encode("utf-8", "replace"))
    if size > limits.max_schema_bytes:
        raise OpenAIError(f"{param} is {size} bytes; at most {limits.max_schema_bytes} are "
                          f"allowed (--max-schema-bytes)", param=param)


def check_constraint_sizes(request: Any, limits: RequestLimitsConfig) -> None:
    fmt = getattr(request, "response_format", None)
    if isinstance(fmt, dict):
        spec = fmt.get("json_schema")
        if isinstance(spec, dict):
            _check_one(spec.get("schema", spec.get("json_schema")),
                       "response_format.json_schema.schema", limits)
    _check_one(getattr(request, "structured_outputs", None), "structured_outputs", limits)
    tools = getattr(request, "tools", None)
    if tools:
        if len(tools) > limits.max_tools:
            raise OpenAIError(f"tools has {len(tools)} entries; at most {limits.max_tools} are "
                              f"allowed (--max-tools)", param="tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict):
                _check_one(function.get("parameters"), f"tools[{i}].function.parameters",
                           limits)
