"""Structured output requests at the edge: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, and the Responses API's `text.format`,
each turned into one `StructuredOutputsParams` and checked here, so a schema or grammar that does
not compile is a 400 naming the field and never reaches the engine."""

from __future__ import annotations

import json
from typing import Any

import trio

from triode.actors import check_grammar
from triode.wire import StructuredOutputsParams

from .. import json_text
from ..errors import APIError

# Larger constraints are checked in a worker thread, so the event loop goes on meanwhile.
_OFFLOAD_CHARS = 4096

# vLLM's structured_outputs fields that change nothing here, accepted at their defaults.
_BENIGN = {
    "disable_fallback": (False, True, None),
    "disable_any_whitespace": (False, True, None),
    "disable_additional_properties": (False, None),
    "backend": (None, "auto", "guidance", "llguidance", "xgrammar", "outlines"),
    "structural_tag": (None,),
    "whitespace_pattern": (None,),
}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(req: Any) -> tuple[str, StructuredOutputsParams] | None:
    """The constraint a chat or completions request asks for and the field that set it; a 400
    when several fields set one or one is malformed."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format is not None:
        so = _response_format(req.response_format, "response_format")
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    guided = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    for field, kind in guided.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, _one(kind, value, field)))
    if req.guided_whitespace_pattern is not None:
        raise APIError(
            400,
            "guided_whitespace_pattern: a custom whitespace pattern is not supported",
            param="guided_whitespace_pattern",
        )
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"{found[1][0]}: only one constraint per request ({names})",
                       param=found[1][0])  # fmt: skip
    return found[0] if found else None


def structured_from_text_format(fmt: Any, *, param: str) -> StructuredOutputsParams | None:
    """The Responses API's `text.format`: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "name", "schema", "strict", "description"}`."""
    if not isinstance(fmt, dict):
        raise APIError(400, f"{param}: must be an object", param=param)
    kind = fmt.get("type")
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise APIError(400, f"{param}: unknown field {sorted(extra)[0]!r}", param=param)
        return _schema(fmt.get("schema"), param)
    return _response_format({k: v for k, v in fmt.items() if k != "name"}, param)


def structured_from_grammar(lark: str) -> StructuredOutputsParams:
    """A constraint from a Lark grammar that triode built itself (tool calls)."""
    return StructuredOutputsParams(grammar=lark)


async def check_structured(so: StructuredOutputsParams | None, *, param: str) -> None:
    """A 400 naming `param` unless the constraint compiles."""
    if so is None:
        return
    size = sum(len(x) for x in (so.json, so.regex, so.grammar) if x) + sum(
        len(c) for c in so.choice or ()
    )
    try:
        if size > _OFFLOAD_CHARS:
            await trio.to_thread.run_sync(check_grammar, so)
        else:
            check_grammar(so)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def _response_format(fmt: Any, param: str) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError(400, f"{param}: must be an object with a type", param=param)
    kind = fmt["type"]
    if kind == "text":
        _only(fmt, {"type"}, param)
        return None
    if kind == "json_object":
        _only(fmt, {"type"}, param)
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        _only(fmt, {"type", "json_schema"}, param)
        spec = fmt.get("json_schema")
        where = f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise APIError(400, f"{where}: must be an object", param=where)
        _only(spec, {"name", "schema", "strict", "description"}, where)
        if not isinstance(spec.get("name"), str):
            raise APIError(400, f"{where}.name: required, a string", param=f"{where}.name")
        return _schema(spec.get("schema"), f"{where}.schema")
    raise APIError(
        400,
        f"{param}: type must be text, json_object or json_schema, not {kind!r}",
        param=param,
    )


def _schema(schema: Any, param: str) -> StructuredOutputsParams:
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
    try:
        json_text.check_depth(schema)
    except ValueError as e:
        raise APIError(400, f"{param}: the JSON schema is {e}", param=param) from None
    return StructuredOutputsParams(json=json.dumps(schema, ensure_ascii=False))


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be an object", param=param)
    kinds = []
    for name, field_value in value.items():
        if name in _KINDS:
            if field_value not in (None, False):
                kinds.append((name, field_value))
        elif name in _BENIGN:
            if field_value not in _BENIGN[name]:
                raise APIError(
                    400, f"{param}.{name}: {field_value!r} is not supported", param=param
                )
        else:
            raise APIError(400, f"{param}: unknown field {name!r}", param=param)
    if len(kinds) != 1:
        raise APIError(400, f"{param}: set exactly one of {', '.join(_KINDS)}", param=param)
    [(kind, field_value)] = kinds
    return _one(kind, field_value, f"{param}.{kind}")


def _one(kind: str, value: Any, param: str) -> StructuredOutputsParams:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json_text.loads(value)
            except ValueError as e:
                raise APIError(400, f"{param}: not valid JSON: {e}", param=param) from e
        return _schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise APIError(400, f"{param}: must be true", param=param)
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise APIError(
                400, f"{param}: must be a non-empty list of non-empty strings", param=param
            )
        return StructuredOutputsParams(choice=value)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: must be a non-empty string", param=param)
    return StructuredOutputsParams(**{kind: value})


def _only(fields: dict[str, Any], allowed: set[str], param: str) -> None:
    extra = set(fields) - allowed
    if extra:
        raise APIError(400, f"{param}: unknown field {sorted(extra)[0]!r}", param=param)
