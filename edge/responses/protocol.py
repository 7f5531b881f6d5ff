"""The Responses API's bodies: the request, its input items as chat messages, the response
object with its output items, and the stream of typed events that builds one.

Requests are strict like the rest of the edge (unknown fields are a 400 naming the field);
input items are checked one by one so that an error names its place (`input[2].call_id`).
`ResponseBuilder` is the one place that changes a response's output: every change both updates
the response object and, when streaming, queues the SSE event that tells the client about it,
so a streamed snapshot and the stored response cannot disagree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..completions.request_bodies import MAX_CACHE_SALT
from ..errors import APIError, validation_error
from ..json_text import nesting_error

# Requests

# Characters of `instructions`: a system prompt this long is past any context window a server
# runs (about 250k tokens); it is stored with the response, so it is capped like metadata
# (OpenAI's 16 pairs of 64-character keys and 512-character values).
MAX_INSTRUCTIONS = 1 << 20


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A `POST /v1/responses` body."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: Annotated[str, Meta(max_length=MAX_INSTRUCTIONS)] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    background: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, Meta(max_length=512)]] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    reasoning: dict[str, Any] | None = None
    # Only requests with the same salt share cached prefix blocks (vLLM's field).
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # Accepted and ignored: they do not change the answer.
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    # Accepted, refused when set.
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None

    def __post_init__(self) -> None:
        _check(self.stream_options is None or bool(self.stream), "stream_options",
               "only allowed when stream is true")  # fmt: skip
        _check(not (self.background and self.store is False), "background",
               "a background response must be stored (store: true)")  # fmt: skip
        _check(self.truncation != "auto", "truncation", "only 'disabled' is supported")
        _check(not self.top_logprobs, "top_logprobs", "logprobs are not supported here")
        if self.metadata is not None:
            _check(len(self.metadata) <= 16, "metadata", "at most 16 pairs")
            _check(all(len(k) <= 64 for k in self.metadata), "metadata",
                   "keys are at most 64 characters")  # fmt: skip
        if self.reasoning is not None:
            _check(all(v is None for v in self.reasoning.values()), "reasoning",
                   "reasoning options are not supported")  # fmt: skip
        for name in ("prompt", "conversation", "context_management"):
            _check(getattr(self, name) is None, name, "not supported")


_request_decoder = msgspec.json.Decoder(ResponsesRequest)


def decode_responses_request(body: bytes) -> ResponsesRequest:
    """Decode and validate a body; any failure is a 400 `APIError` naming the field."""
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, ValueError) as e:
        raise validation_error(e) from e
    except RecursionError:  # msgspec's limit on nesting in `Any` fields
        raise APIError(400, "invalid JSON: nested too deeply") from None


class McpToolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One `{"type": "mcp"}` entry of `tools`."""

    type: Literal["mcp"]
    server_label: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    server_url: str | None = None
    server_description: str | None = None
    allowed_tools: list[str] | dict[str, Any] | None = None
    require_approval: Literal["never"] | dict[str, Any] | None = "never"
    headers: dict[str, str] | None = None
    authorization: str | None = None
    connector_id: str | None = None

    def __post_init__(self) -> None:
        _check(self.require_approval in ("never", None) or _never(self.require_approval),
               "require_approval", "only 'never' is supported")  # fmt: skip
        _check(not self.headers, "headers", "headers for a tool server are not supported")
        _check(self.authorization is None, "authorization", "not supported")
        _check(self.connector_id is None, "connector_id", "connectors are not supported")
        if isinstance(self.allowed_tools, dict):
            _check(set(self.allowed_tools) <= {"tool_names", "read_only"}, "allowed_tools",
                   "give a list of names or {tool_names}")  # fmt: skip
            _check(not self.allowed_tools.get("read_only"), "allowed_tools",
                   "read_only filtering is not supported")  # fmt: skip
            names = self.allowed_tools.get("tool_names")
            _check(names is None or (isinstance(names, list) and
                   all(isinstance(n, str) for n in names)),
                   "allowed_tools", "tool_names must be a list of strings")  # fmt: skip

    def allowed(self) -> set[str] | None:
        """The tool names to offer, or None for all of the server's tools."""
        if isinstance(self.allowed_tools, dict):
            names = self.allowed_tools.get("tool_names")
            return None if names is None else set(names)
        return None if self.allowed_tools is None else set(self.allowed_tools)


def _never(policy: dict[str, Any]) -> bool:
    # {"never": {"tool_names": [...]}} with no "always" is a never-policy for those tools;
    # anything that can ask for approval is not.
    return set(policy) <= {"never"} and policy.get("always") is None


def mcp_tool_specs(tools: list[dict[str, Any]] | None) -> list[tuple[int, McpToolSpec]]:
    """The MCP entries of `tools`, with their indexes; a 400 for a tool type other than function
    and mcp, and for a malformed or repeated MCP entry."""
    specs: list[tuple[int, McpToolSpec]] = []
    labels: set[str] = set()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "function":
            continue
        if kind != "mcp":
            raise APIError(400, f"tools[{i}].type: {kind!r} tools are not supported; use "
                           "function or mcp", param=f"tools[{i}].type")  # fmt: skip
        spec = _convert(tool, McpToolSpec, f"tools[{i}]")
        if spec.server_label in labels:
            raise APIError(400, f"tools[{i}].server_label: {spec.server_label!r} is given twice",
                           param=f"tools[{i}].server_label")  # fmt: skip
        labels.add(spec.server_label)
        specs.append((i, spec))
    return specs


# Input items


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
            item = _convert(raw, _MessageItem, where)
            text = _content_text(item.content, f"{where}.content")
            messages.append({"role": _ROLES.get(item.role, item.role), "content": text})
        elif kind == "function_call":
            call = _convert(raw, _FunctionCallItem, where)
            _check_arguments(call.arguments, f"{where}.arguments")
            _append_call(messages, call.call_id, call.name, call.arguments)
            calls.add(call.call_id)
        elif kind == "mcp_call":
            mcp = _convert(raw, _McpCallItem, where)
            _check_arguments(mcp.arguments, f"{where}.arguments")
            call_id = mcp.id or new_id("mcp")
            _append_call(messages, call_id, mcp_name(mcp.server_label, mcp.name), mcp.arguments)
            result = mcp.output if mcp.error is None else f"error: {_error_text(mcp.error)}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result or ""})
        elif kind == "function_call_output":
            out = _convert(raw, _FunctionCallOutputItem, where)
            if out.call_id not in calls:
                raise APIError(400, f"{where}.call_id: no function call found with call_id "
                               f"{out.call_id!r}", param=f"{where}.call_id")  # fmt: skip
            text = _content_text(out.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": out.call_id, "content": text})
        elif kind == "mcp_list_tools":
            _convert(raw, _McpListToolsItem, where)  # what the model was offered; no message
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
            texts.append(_convert(part, _Refusal, f"{where}[{j}]").refusal)
        elif kind in ("input_text", "output_text", "text"):
            texts.append(_convert(part, _InputText, f"{where}[{j}]").text)
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


def _convert(value: Any, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        error = validation_error(e)
        param = where if error.param is None else f"{where}.{error.param}"
        message = error.message if error.param is None else error.message[len(error.param) + 2 :]
        raise APIError(400, f"{param}: {message}", param=param) from e


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")


# The response and its output items


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"
    content: list[OutputText] = []


class FunctionCall(msgspec.Struct, kw_only=True):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"


class McpToolInfo(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: Any = None
    annotations: Any = None


class McpListTools(msgspec.Struct, kw_only=True):
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    id: str
    server_label: str
    tools: list[McpToolInfo] = []
    error: str | None = None


class McpCall(msgspec.Struct, kw_only=True):
    type: Literal["mcp_call"] = "mcp_call"
    id: str
    server_label: str
    name: str
    arguments: str = ""
    output: str | None = None
    error: dict[str, Any] | None = None
    status: str = "in_progress"
    approval_request_id: str | None = None


OutputItem = OutputMessage | FunctionCall | McpListTools | McpCall


def mcp_error(message: str) -> dict[str, Any]:
    """An `mcp_call` item's `error`, in the SDK's shape for a failed tool."""
    return {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": message}]}


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    def add(self, *, input_tokens: int, output_tokens: int, cached_tokens: int) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.input_tokens_details.cached_tokens += cached_tokens
        self.total_tokens = self.input_tokens + self.output_tokens


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int = msgspec.field(default_factory=_now)
    completed_at: int | None = None
    status: Status = "in_progress"
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


def output_text(response: Response) -> str:
    """The text of every output message, joined: what the SDK's `output_text` gives."""
    return "".join(
        part.text
        for item in response.output
        if isinstance(item, OutputMessage)
        for part in item.content
    )


# Events


class _Event(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int


class ResponseEvent(_Event, kw_only=True):
    response: Response


class OutputItemEvent(_Event, kw_only=True):
    output_index: int
    item: OutputItem


class ItemProgressEvent(_Event, kw_only=True):
    """An event about one output item; the base of those about its content and arguments."""

    item_id: str
    output_index: int


class _ContentEvent(ItemProgressEvent, kw_only=True):
    content_index: int


class ContentPartEvent(_ContentEvent, kw_only=True):
    part: OutputText


class TextDeltaEvent(_ContentEvent, kw_only=True):
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(_ContentEvent, kw_only=True):
    text: str
    logprobs: list[Any] = []


class ArgumentsDeltaEvent(ItemProgressEvent, kw_only=True):
    delta: str


class ArgumentsDoneEvent(ItemProgressEvent, kw_only=True):
    arguments: str


class ErrorEvent(_Event, kw_only=True):
    code: str | None = None
    message: str
    param: str | None = None


_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)
