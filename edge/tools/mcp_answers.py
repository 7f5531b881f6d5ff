"""What an MCP server's answers may become on this side: the tools of a listing the model may
see, a tool's output and error cut to a size, and a failure told in this server's own words.

A tool server is a peer this server trusts less than its operator, and a request-named one not
at all: what it lists goes into prompts and grammars, what it returns into the conversation
that is stored with a response, and its failures to the client. So a listing offers at most
`MAX_TOOLS` tools (OpenAI's bound per request), each with a name a function may have, a
description of at most `MAX_DESCRIPTION` characters and a schema of at most `MAX_SCHEMA_BYTES`;
output is cut at `MAX_OUTPUT_CHARS` and a tool's error at `MAX_ERROR_CHARS`; and `summary`
says what went wrong without the exceptions' text, which may carry a server's answer or this
host's addresses and paths (`describe` has it all, for the log).

These run inside MCP operations, which have loaded the `mcp` SDK: it is imported lazily here,
so that importing this module does not load it.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import re
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
import httpx2
import msgspec

if TYPE_CHECKING:
    from mcp import MCPError
    from mcp.types import CallToolResult, Tool

from ..errors import leaf_errors
from .destinations import DestinationRefused

log = logging.getLogger("triode.edge.mcp")

MAX_TOOLS = 128
MAX_DESCRIPTION = 1024
MAX_SCHEMA_BYTES = 64 << 10
MAX_OUTPUT_CHARS = 256 << 10
MAX_ERROR_CHARS = 4 << 10
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CONNECTION_ERRORS = (
    httpx2.TransportError,
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)


class MCPTool(msgspec.Struct):
    """One tool as a server lists it."""

    name: str
    description: str | None
    input_schema: dict[str, Any]


def _mcp_error() -> type[MCPError]:
    """The SDK's error type; these functions run inside MCP operations, which loaded it."""
    from mcp import MCPError

    return MCPError


def is_connection_error(exc: BaseException) -> bool:
    from mcp.types import CONNECTION_CLOSED

    if isinstance(exc, _mcp_error()):
        return exc.code == CONNECTION_CLOSED
    return isinstance(exc, _CONNECTION_ERRORS)


def describe(errors: BaseException | None) -> str:
    """The distinct messages of the exceptions in `errors`, each with its type's name."""
    if errors is None:
        return "the session was cancelled"
    messages: list[str] = []
    mcp_error = _mcp_error()
    for exc in leaf_errors(errors):
        text = exc.message if isinstance(exc, mcp_error) else str(exc)
        message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        if message not in messages:
            messages.append(message)
    return "; ".join(messages)


def summary(errors: BaseException) -> str:
    """What went wrong, in words of this module's (never an exception's own text, which may
    carry a server's answer or this host's internals): the first cause that says something."""
    for exc in leaf_errors(errors):
        for cause in _causes(exc):
            if isinstance(cause, DestinationRefused):
                return str(cause)  # written by destinations.py: names the host and address
            if isinstance(cause, ConnectionRefusedError) or (
                isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
            ):
                return "connection refused"
            if isinstance(cause, socket.gaierror):
                return "the host name does not resolve"
            if isinstance(cause, httpx2.HTTPStatusError):
                return f"the server answered HTTP {cause.response.status_code}"
            if isinstance(cause, httpx2.TimeoutException | TimeoutError):
                return "timed out"
            if isinstance(cause, _mcp_error()):
                return f"the server answered with MCP error {cause.code}"
    for exc in leaf_errors(errors):
        if is_connection_error(exc):
            return "the connection failed"
    return "an unexpected error (the server log has it)"


def _causes(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """`exc`, what it groups and what it was raised from, depth first."""
    if depth > 16:  # a chain this long says nothing more
        return
    yield exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _causes(inner, depth + 1)
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        yield from _causes(cause, depth + 1)


def offered_tools(url: str, tools: list[Tool]) -> list[MCPTool]:
    """The tools of a listing that the model may see: at most `MAX_TOOLS`, each with a name a
    function may have and a schema of at most `MAX_SCHEMA_BYTES`; descriptions are cut."""
    offered = []
    for t in tools:
        schema = dict(t.input_schema)
        if not _TOOL_NAME.fullmatch(t.name) or _json_size(schema) > MAX_SCHEMA_BYTES:
            log.warning(
                "MCP server %s: tool %.80r is not offered (its name or schema)", url, t.name
            )
            continue
        if len(offered) == MAX_TOOLS:
            log.warning("MCP server %s lists more than %d tools; the rest are not offered",
                        url, MAX_TOOLS)  # fmt: skip
            break
        description = None if t.description is None else cut(t.description, MAX_DESCRIPTION)
        offered.append(MCPTool(t.name, description, schema))
    return offered


def _json_size(value: Any) -> float:
    try:
        return len(json.dumps(value))
    except (ValueError, TypeError, RecursionError):
        return math.inf


def cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[cut: {len(text) - limit} more characters]"


def result_text(result: CallToolResult) -> str:
    """The text blocks of a result (and the text of embedded text resources), joined."""
    from mcp.types import EmbeddedResource, TextContent, TextResourceContents

    parts = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, EmbeddedResource) and isinstance(
            block.resource, TextResourceContents
        ):
            parts.append(block.resource.text)
    return "\n".join(parts)


def result_output(result: CallToolResult) -> str:
    """A successful result as text: its text, else its structured content as JSON."""
    text = result_text(result)
    if not text and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return text
