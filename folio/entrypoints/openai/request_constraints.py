"""Request fields that constrain the output's shape -> StructuredOutputsParams.

* OpenAI's ``response_format``: ``text``, ``json_object``, ``json_schema`` (``strict`` accepted:
  folio always enforces the schema).
* vLLM's ``structured_outputs`` extra: one of ``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``, ``structural_tag``, plus the options ``disable_any_whitespace``,
  ``disable_fallback``, ``disable_additional_properties``, ``whitespace_pattern``, and folio's
  ``best_effort``.
* Tool calling: ``tool_choice`` "required" and a named function are enforced by a JSON schema
  (so the call always parses and matches the parameters); "auto" with ``strict: true``
  functions uses a structural tag that constrains only the calls, in the parser's format.

Every problem is an OpenAIError (400) naming the field; so is a JSON schema that no backend
fully enforces, unless the request sets ``best_effort``: the response then carries
``structured_outputs_notice`` (left in the request's ConstraintContext). Each fallback (xgrammar
rejected it, a feature xgrammar does not enforce sent it to guidance, best-effort partial
enforcement) is counted in the engine's metrics, ``folio:structured_outputs_fallbacks_total``.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from folio.entrypoints.openai.errors import OpenAIError
from folio.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SO_FIELDS = {f.name for f in dataclass_fields(StructuredOutputsParams) if f.init}


@dataclass
class ConstraintContext:
    """What building one request's constraint needs and reports: the engine's backend (the
    front end must route as the engine will), its metrics (fallbacks are counted), and, after
    a best_effort constraint was built, the notice saying what is not enforced."""

    backend: str = "auto"
    metrics: Any = None
    notice: str | None = None


def constraint_context(engine: Any) -> ConstraintContext:
    config = getattr(getattr(engine, "config", None), "structured_outputs", None)
    return ConstraintContext(getattr(config, "backend", "auto"), getattr(engine, "metrics", None))


def _context(ctx: ConstraintContext | str) -> ConstraintContext:
    # A bare backend name (tests, tools): no metrics, and the notice is not kept.
    return ConstraintContext(ctx) if isinstance(ctx, str) else ctx


def record_route(route: Any, metrics: Any = None) -> None:
    """Count (and log at debug level) a request's constraint fallback, if it had one."""
    code = getattr(route, "fallback_reason_code", None)
    if code is None:
        return
    logger.debug("structured outputs fallback %s on %s: %s", code, route.backend,
                 route.notice or route.detail)
    if metrics is not None and hasattr(metrics, "structured_outputs_fallback"):
        metrics.structured_outputs_fallback(code)


def _make(param: str, ctx: ConstraintContext | str, **kwargs: Any) -> StructuredOutputsParams:
    """Build and check (a tokenizer-free parse, as the engine's backend would compile it), so
    a bad schema is a 400 naming the request field it came from."""
    from folio.structured_output.validation import validate_constraint
    ctx = _context(ctx)
    try:
        params = StructuredOutputsParams(**kwargs)
        route = validate_constraint(params, ctx.backend)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(str(exc), param=param) from exc
    record_route(route, ctx.metrics)
    if route.partial:
        ctx.notice = route.notice
    return params


def from_response_format(fmt: dict[str, Any] | None, ctx: ConstraintContext | str = "auto"
                         ) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("response_format must be an object", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", ctx, json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError("response_format.json_schema must be an object with a 'schema'",
                              param="response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI allows omitting the schema; any JSON object then satisfies it.
            return _make("response_format.json_schema", ctx, json_object=True)
        return _make("response_format.json_schema.schema", ctx, json=schema)
    raise OpenAIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", param="response_format.type")


def from_structured_outputs(value: dict[str, Any] | None, ctx: ConstraintContext | str = "auto"
                            ) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - _SO_FIELDS)
    if unknown:
        raise OpenAIError(f"unknown structured_outputs field(s): {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(_SO_FIELDS))}", param="structured_outputs")
    kwargs = dict(value)
    if isinstance(kwargs.get("structural_tag"), dict):
        kwargs["structural_tag"] = json.dumps(kwargs["structural_tag"])
    return _make("structured_outputs", ctx, **kwargs)


def request_constraint(request: Any, ctx: ConstraintContext | str = "auto"
                       ) -> StructuredOutputsParams | None:
    """The constraint a completions or chat request asks for (at most one source)."""
    from_format = from_response_format(getattr(request, "response_format", None), ctx)
    from_extra = from_structured_outputs(getattr(request, "structured_outputs", None), ctx)
    if from_format is not None and from_extra is not None:
        raise OpenAIError("give either response_format or structured_outputs, not both",
                          param="structured_outputs")
    return from_format or from_extra


# ---- tool calling ------------------------------------------------------------------------

def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", {})


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def named_function(tools: list[dict[str, Any]], tool_choice: dict[str, Any]) -> dict[str, Any]:
    """The function a named tool_choice picks; 400 if it is not among the tools."""
    chosen = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = chosen.get("name") if isinstance(chosen, dict) else None
    if not isinstance(name, str):
        raise OpenAIError('a named tool_choice must be {"type": "function", "function": '
                          '{"name": ...}}', param="tool_choice")
    for tool in tools:
        if _function(tool).get("name") == name:
            return _function(tool)
    raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools",
                      param="tool_choice")


def forced_tool_constraint(tools: list[dict[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool | None,
                           ctx: ConstraintContext | str = "auto") -> StructuredOutputsParams:
    """The grammar for tool_choice "required" (a JSON array of {"name", "parameters"} calls,
    one or more; at most one when parallel_tool_calls is false) or a named function (its
    arguments object)."""
    if isinstance(tool_choice, dict):
        return _make("tools", ctx, json=_parameters(named_function(tools, tool_choice)))
    variants = []
    for tool in tools:
        function = _function(tool)
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": _parameters(function)},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return _make("tools", ctx, json=schema)


# How a call begins and ends in each parser's format, for strict functions under "auto".
_CALL_FORMATS: dict[str, tuple[str, str, str, str]] = {
    # parser: (trigger, begin template, end, argument key)
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>",
               "arguments"),
    "llama3_json": ('{"name": ', '{{"name": {name}, "parameters": ', "}", "parameters"),
}


def strict_tools_constraint(tools: list[dict[str, Any]], parser_name: str | None,
                            ctx: ConstraintContext | str = "auto"
                            ) -> StructuredOutputsParams | None:
    """tool_choice "auto" with `strict: true` functions: a structural tag that leaves free
    text free and constrains each call of a strict function (from its opening marker) to the
    parser's format with arguments matching the schema. None when no function is strict or
    the parser's format has no tag form here."""
    strict = [_function(t) for t in tools if _function(t).get("strict") is True]
    if not strict or parser_name not in _CALL_FORMATS:
        return None
    trigger, begin, end, _ = _CALL_FORMATS[parser_name]
    structures = [{"begin": begin.format(name=json.dumps(f["name"])), "schema": _parameters(f),
                   "end": end}
                  for f in strict]
    return _make("tools", ctx, structural_tag=json.dumps({"structures": structures,
                                                      "triggers": [trigger]}))
