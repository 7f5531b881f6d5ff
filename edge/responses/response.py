"""The Responses API's response object: its output items, usage, status and error.

A response's output only changes through `ResponseBuilder` (`output.py`), which queues the
stream event telling a streaming client about each change.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec


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
