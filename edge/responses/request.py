"""The `POST /v1/responses` request body, its MCP tool entries, and their decoding.

Requests are strict like the rest of the edge (unknown fields are a 400 naming the field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..completions.request_bodies import MAX_CACHE_SALT
from ..errors import APIError
from ..http import Request
from ..ignored_fields import decode_request_body
from .input_items import convert_item

# Characters of `user`, an end user's identifier
MAX_USER = 256
# Characters of `instructions`: a system prompt this long is past any context window a server
# runs (about 250k tokens); it is stored with the response, so it is capped like metadata
# (OpenAI's 16 pairs of 64-character keys and 512-character values).
MAX_INSTRUCTIONS = 1 << 20


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """A `POST /v1/responses` body. Top-level fields it does not know are ignored and named in
    the response (`edge/ignored_fields.py`)."""

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
    # kept with the response: capped as metadata's values are (OpenAI's identifiers are short)
    user: Annotated[str, Meta(max_length=MAX_USER)] | None = None
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


def decode_responses_request(body: bytes, http: Request | None = None) -> ResponsesRequest:
    """Decode and validate a body; any failure is a 400 `APIError` naming the field. The
    top-level fields it ignored are announced on `http`'s response."""
    return decode_request_body(body, ResponsesRequest, http)


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
        spec = convert_item(tool, McpToolSpec, f"tools[{i}]")
        if spec.server_label in labels:
            raise APIError(400, f"tools[{i}].server_label: {spec.server_label!r} is given twice",
                           param=f"tools[{i}].server_label")  # fmt: skip
        labels.add(spec.server_label)
        specs.append((i, spec))
    return specs


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")
