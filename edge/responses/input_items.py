"""A Responses request's input items, as the chat messages the model is prompted with.

Input items are checked one by one so that an error names its place (`input[2].call_id`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..errors import APIError, validation_error
from ..json_text import nesting_error
from .response import new_id


class _InputText(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Refusal(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["refusal"]
    refusal: str


class _MessageItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class _McpCallItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["mcp_call"]
    server_label: str
    name: str
    arguments: str
    id: str | None = None
    output: str | None = None
    error: Any = None
    status: str | None = None
    approval_request_id: str | None = None


class _McpListToolsItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["mcp_list_tools"]
    server_label: str
    tools: list[Any]
    id: str | None = None
    error: Any = None


_ROLES = {"developer": "system"}  # chat templates know system, few know developer


def input_messages(
    value: str | list[dict[str, Any]],
    *,
    mcp_name: Callable[[str, str], str],
    history: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The chat messages for a request's `input`, which follows `history` (chat messages).

    Consecutive calls become one assistant message with `tool_calls` (joined to the assistant
    text before them); outputs become `tool` messages and must answer a call made before them.
    MCP calls are named with `mcp_name(server_label, tool)`, as the model saw them. Raises a
    400 `APIError` naming the item and field.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "message":
            item = convert_item(raw, _MessageItem, where)
            text = _content_text(item.content, f"{where}.content")
            messages.append({"role": _ROLES.get(item.role, item.role), "content": text})
        elif kind == "function_call":
            call = convert_item(raw, _FunctionCallItem, where)
            _check_arguments(call.arguments, f"{where}.arguments")
            _append_call(messages, call.call_id, call.name, call.arguments)
            calls.add(call.call_id)
        elif kind == "mcp_call":
            mcp = convert_item(raw, _McpCallItem, where)
            _check_arguments(mcp.arguments, f"{where}.arguments")
            call_id = mcp.id or new_id("mcp")
            _append_call(messages, call_id, mcp_name(mcp.server_label, mcp.name), mcp.arguments)
            result = mcp.output if mcp.error is None else f"error: {_error_text(mcp.error)}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result or ""})
        elif kind == "function_call_output":
            out = convert_item(raw, _FunctionCallOutputItem, where)
            if out.call_id not in calls:
                raise APIError(400, f"{where}.call_id: no function call found with call_id "
                               f"{out.call_id!r}", param=f"{where}.call_id")  # fmt: skip
            text = _content_text(out.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": out.call_id, "content": text})
        elif kind == "mcp_list_tools":
            convert_item(raw, _McpListToolsItem, where)  # what the model was offered; no message
        else:
            raise APIError(400, f"{where}.type: {kind!r} input items are not supported",
                           param=f"{where}.type")  # fmt: skip
    return messages


def _check_arguments(arguments: str, param: str) -> None:
    if (too_deep := nesting_error(arguments)) is not None:
        raise APIError(400, f"{param}: {too_deep}", param=param)


def _append_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    # calls in a row are one assistant turn, with the text the assistant said before them
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _content_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "refusal":
            texts.append(convert_item(part, _Refusal, f"{where}[{j}]").refusal)
        elif kind in ("input_text", "output_text", "text"):
            texts.append(convert_item(part, _InputText, f"{where}[{j}]").text)
        else:
            raise APIError(400, f"{where}[{j}].type: only text content is supported, not "
                           f"{kind!r}", param=f"{where}[{j}].type")  # fmt: skip
    return "\n".join(texts)


def _error_text(error: Any) -> str:
    if isinstance(error, Mapping):
        if isinstance(error.get("message"), str):
            return error["message"]
        content = error.get("content")
        if isinstance(content, list):
            return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, Mapping))
    return str(error)


def convert_item(value: Any, kind: type[Any], where: str) -> Any:
    """`value`, a JSON item at `where` in the body, as a `kind`; a 400 `APIError` naming the
    field in it (`input[2].call_id`) when it is not one."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        error = validation_error(e)
        param = where if error.param is None else f"{where}.{error.param}"
        message = error.message if error.param is None else error.message[len(error.param) + 2 :]
        raise APIError(400, f"{param}: {message}", param=param) from e
