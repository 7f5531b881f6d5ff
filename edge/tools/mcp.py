"""The MCP tool servers that `/v1/responses` may use: their tools, and calls to them.

A server is configured as `URL`, `label=URL` or `host:port` (which means `http://host:port/sse`).
A URL whose path ends in `/sse` is spoken to with the SSE transport, any other with streamable
HTTP. A server's label is the `label=` given, else the `serverInfo.name` it reports once reached
(unless another server already has that label), else its `host:port`; a request may also name a
configured server by its URL or its `host:port`.

Every operation opens its own MCP session (connect and handshake, one request, close), all of it
inside one cancel scope whose deadline follows the phase: `connect_timeout` to connect and
handshake, `call_timeout` for the request, `CLOSE_TIMEOUT` to close. A session is never reused,
so one that broke cannot break a later call, and a server that restarts is picked up by the next
operation. Nothing runs in the background: a `ToolServers` needs no nursery, only `start()`.

A server a request names by URL (allowed by `allow_request_servers`) is reached only at public
addresses (`destinations.py`) unless `allow_private_servers`. What any server sends is bounded,
and its failures are told in this server's own words ("cannot connect: connection refused"),
their exceptions' text going to the log only (`mcp_answers.py`).

The `mcp` SDK (over half a second to import) is imported lazily, inside the operations: an API
server that never reaches an MCP server never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import httpx2
import msgspec
import trio

if TYPE_CHECKING:
    from mcp import Client
    from mcp.types import Implementation, Tool

from .destinations import DestinationRefused, check_destination, checked_client
from .mcp_answers import (
    MAX_ERROR_CHARS,
    MAX_OUTPUT_CHARS,
    MAX_TOOLS,
    MCPTool,
    cut,
    describe,
    is_connection_error,
    offered_tools,
    result_output,
    result_text,
    summary,
)

log = logging.getLogger("triode.edge.mcp")

CLOSE_TIMEOUT = 2.0
MAX_LIST_PAGES = 100


def _version() -> str:
    try:
        return importlib.metadata.version("triode")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


@functools.cache
def client_info() -> Implementation:
    """What this server says it is to an MCP server. The SDK (0.6 s to import) loads with the
    first MCP operation, never when a server starts without one."""
    from mcp.types import Implementation

    return Implementation(name="triode", version=_version())


_T = TypeVar("_T")
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
_HOST_PORT = re.compile(r"[A-Za-z0-9.-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}")


class ToolServerError(Exception):
    """A request named a tool server it may not use, or one that is not configured."""


class ToolServerUnavailable(ToolServerError):
    """A tool server could not be reached, or did not answer; the message says why."""


class ToolResult(msgspec.Struct):
    """What a tool call gave: its text, or `error` (and no text) when the call failed."""

    output: str
    error: str | None = None


def parse_tool_server_specs(value: str) -> list[str]:
    """The entries of a comma-separated `--tool-server` value, each as `URL` or `label=URL`
    (a bare `host:port` becomes `http://host:port/sse`). Raises ValueError naming a bad entry."""
    specs = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        label, url = _parse_spec(entry)
        specs.append(url if label is None else f"{label}={url}")
    return specs


def _parse_spec(entry: str) -> tuple[str | None, str]:
    """(label or None, URL) of one server entry; ValueError if it is none of the three forms."""
    label = None
    head, sep, rest = entry.partition("=")
    if sep and _LABEL.fullmatch(head):
        label, entry = head, rest.strip()
    if "://" not in entry and _HOST_PORT.fullmatch(entry):
        entry = f"http://{entry}/sse"
    return label, _check_url(entry)


def _check_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host, else ValueError."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as e:
        raise ValueError(f"{url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            f"{url!r} is not an http:// or https:// URL (nor label=URL, nor host:port)"
        )
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    return url


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _as_label(text: str) -> str:
    """`text` as a label a request can name (OpenAI allows letters, digits, _ and -)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


@dataclass
class _Server:
    url: str
    label: str
    settled: bool  # the label was configured or reported, and stays
    tools: list[MCPTool] | None = None  # None: never listed, or its last session broke


class _Failed(Exception):
    """An operation on a server failed; `connection` when the server itself is in doubt (it
    could not be reached, or the connection broke), not only the request."""

    def __init__(self, message: str, *, connection: bool) -> None:
        super().__init__(message)
        self.connection = connection


class ToolServers:
    """The configured MCP servers (and, if allowed, ones a request names by URL).

    `start()` lists each configured server's tools; `list_tools()` answers from that listing
    and lists again for a server that was down or whose last session broke; `call()` calls a
    tool and turns every failure of the server or the tool into a `ToolResult` with `error`.
    """

    def __init__(
        self,
        specs: list[str],
        *,
        call_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        allow_request_servers: bool = False,
        allow_private_servers: bool = False,
    ) -> None:
        self._call_timeout = call_timeout
        self._connect_timeout = connect_timeout
        self._allow_request_servers = allow_request_servers
        self._allow_private_servers = allow_private_servers
        self._servers: list[_Server] = []
        for spec in specs:
            label, url = _parse_spec(spec)
            server = _Server(url, label or _as_label(_host_port(url)), settled=label is not None)
            if any(s.label == server.label for s in self._servers):
                raise ValueError(f"two tool servers are labelled {server.label!r}")
            self._servers.append(server)

    async def start(self) -> None:
        """Connect to each configured server (concurrently) and list its tools. A server that
        is down is logged and listed again when a request needs it; nothing here raises. A
        checkpoint; cancelled, the servers not listed yet are listed when first needed."""
        async with trio.open_nursery() as nursery:
            for server in self._servers:
                nursery.start_soon(self._start_one, server)

    def labels(self) -> list[str]:
        """The configured servers' labels, in configuration order."""
        return [s.label for s in self._servers]

    async def list_tools(
        self, label: str | None, *, server_url: str | None = None
    ) -> list[MCPTool]:
        """The tools of the server named by `server_url` (if given) or `label`: a configured
        server's from its last listing (listed again if it was down or its last session
        broke), a request-supplied URL's listed now. A checkpoint; cancelled, nothing changes.

        Raises ToolServerError for an unknown or refused server (a request-supplied one whose
        host resolves to an address it may not be at included), and ToolServerUnavailable when
        the server cannot be reached or does not list its tools.
        """
        server, url = self._resolve(label, server_url)
        if server is not None and server.tools is not None:
            await trio.lowlevel.checkpoint()
            return server.tools
        if server is None:
            await self._check(url)
        try:
            if server is None:
                tools, _ = await self._list(url, checked=True)
                return tools
            return await self._refresh(server)
        except _Failed as e:
            raise ToolServerUnavailable(f"{_where(server, url)}: {e}") from None

    async def call(
        self,
        label: str | None,
        name: str,
        arguments: dict[str, Any],
        *,
        server_url: str | None = None,
    ) -> ToolResult:
        """Call tool `name` on the server named by `server_url` (if given) or `label`. A server
        that is down, a call past `call_timeout`, a protocol error and a tool's own error
        (`isError`) all return a ToolResult with `error` set. A checkpoint; cancelled, the call
        is abandoned (the server may still run it).

        Raises ToolServerError only for an unknown or refused server.
        """
        server, url = self._resolve(label, server_url)
        where = _where(server, url)
        if not isinstance(arguments, dict):
            await trio.lowlevel.checkpoint()
            return ToolResult("", error=f"the arguments of tool {name!r} must be a JSON object")
        if server is None:
            await self._check(url)
        try:
            result, info = await self._session(
                url,
                f"calling tool {name!r}",
                lambda c: c.call_tool(name, arguments),
                checked=server is None,
            )
        except _Failed as e:
            if server is not None and e.connection:
                server.tools = None
            log.warning("%s: %s", where, e)
            return ToolResult("", error=f"{where}: {e}")
        if server is not None:
            self._name(server, info)
        if result.is_error:
            message = cut(result_text(result), MAX_ERROR_CHARS) or "the tool reported an error"
            log.info("%s: tool %r failed: %r", where, name, message)
            return ToolResult("", error=f"tool {name!r} failed: {message}")
        return ToolResult(cut(result_output(result), MAX_OUTPUT_CHARS))

    async def _check(self, url: str) -> None:
        """A ToolServerError unless a request-supplied `url` may be reached. A checkpoint."""
        try:
            await check_destination(url, allow_private=self._allow_private_servers)
        except DestinationRefused as e:
            raise ToolServerError(f"server_url {url!r}: {e}") from None

    def _resolve(self, label: str | None, server_url: str | None) -> tuple[_Server | None, str]:
        """(the configured server or None, the URL to connect to) for a request's names."""
        if server_url is not None:
            for server in self._servers:
                if _same_url(server.url, server_url):
                    return server, server.url
            if not self._allow_request_servers:
                raise ToolServerError(
                    f"server_url {server_url!r} is not a configured tool server, and this "
                    "server does not allow request-supplied tool servers"
                )
            try:
                return None, _check_url(server_url)
            except ValueError as e:
                raise ToolServerError(str(e)) from None
        if label is None:
            raise ToolServerError("a tool server is named by a server_label or a server_url")
        for match in (
            lambda s: s.label == label,
            lambda s: _same_url(s.url, label),
            lambda s: _host_port(s.url) == label,
            lambda s: _as_label(_host_port(s.url)) == label,
        ):
            for server in self._servers:
                if match(server):
                    return server, server.url
        known = ", ".join(repr(s) for s in self.labels()) or "none"
        raise ToolServerError(f"unknown tool server {label!r} (configured: {known})")

    async def _start_one(self, server: _Server) -> None:
        with contextlib.suppress(_Failed):  # logged, and listed again when a request needs it
            await self._refresh(server)

    async def _refresh(self, server: _Server) -> list[MCPTool]:
        """List a configured server's tools and remember them; raises _Failed (logged)."""
        try:
            tools, info = await self._list(server.url)
        except _Failed as e:
            server.tools = None
            log.warning("MCP server %r is unavailable: %s", server.label, e)
            raise
        self._name(server, info)
        server.tools = tools
        log.info("MCP server %r (%s): %d tools", server.label, server.url, len(tools))
        return tools

    async def _list(
        self, url: str, *, checked: bool = False
    ) -> tuple[list[MCPTool], Implementation | None]:
        async def list_all(client: Client) -> list[Tool]:
            tools: list[Tool] = []
            cursor = None
            for _ in range(MAX_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools += page.tools
                if (cursor := page.next_cursor) is None or len(tools) >= MAX_TOOLS:
                    break
            return tools

        tools, info = await self._session(url, "listing tools", list_all, checked=checked)
        return offered_tools(url, tools), info

    @contextlib.asynccontextmanager
    async def _open(self, url: str, *, checked: bool = False) -> AsyncIterator[Client]:
        """A connected MCP client for `url`: SSE for a path ending in `/sse`, else streamable
        HTTP. Its HTTP read timeout only backs up the caller's deadlines. `checked`: a
        request-supplied server, reached only at allowed addresses (`checked_client`)."""
        from mcp import Client
        from mcp.client.sse import sse_client
        from mcp.client.streamable_http import streamable_http_client

        read = self._connect_timeout + self._call_timeout + CLOSE_TIMEOUT
        factory = partial(checked_client, allow_private=self._allow_private_servers)
        if urlsplit(url).path.endswith("/sse"):
            options: dict[str, Any] = {"httpx_client_factory": factory} if checked else {}
            transport = sse_client(
                url, timeout=self._connect_timeout, sse_read_timeout=read, **options
            )
            async with Client(transport, cache=None, client_info=client_info()) as client:
                yield client
            return
        timeout = httpx2.Timeout(self._connect_timeout, read=read)
        http_client = factory(timeout=timeout) if checked else httpx2.AsyncClient(timeout=timeout)
        async with http_client as http:
            transport = streamable_http_client(url, http_client=http)
            async with Client(transport, cache=None, client_info=client_info()) as client:
                yield client

    def _name(self, server: _Server, info: Implementation | None) -> None:
        """Label `server` with its reported name, once, if no label was configured for it."""
        if server.settled or info is None or not info.name:
            return
        server.settled = True
        name = _as_label(info.name)
        if any(s.label == name for s in self._servers):
            return
        log.info("MCP server %s is labelled %r (its serverInfo.name)", server.url, name)
        server.label = name

    async def _session(
        self,
        url: str,
        doing: str,
        request: Callable[[Client], Awaitable[_T]],
        *,
        checked: bool = False,
    ) -> tuple[_T, Implementation | None]:
        """Open a session to `url`, run `request` on it and close it, each phase within its
        timeout: (what `request` returned, the server's info). Raises _Failed. A failure to
        close after `request` answered is only logged."""
        phase = "connecting"
        answered: list[_T] = []
        info: Implementation | None = None
        errors: ExceptionGroup[Exception] | None = None
        with trio.move_on_after(self._connect_timeout) as scope:
            try:
                async with self._open(url, checked=checked) as client:
                    info = client.server_info
                    phase = doing
                    scope.deadline = trio.current_time() + self._call_timeout
                    answered.append(await request(client))
                    phase = "closing"
                    scope.deadline = trio.current_time() + CLOSE_TIMEOUT
            except* Exception as group:
                errors = group
        if answered:
            if errors is not None or scope.cancelled_caught:
                log.debug("closing the MCP session to %s failed: %s", url, describe(errors))
            return answered[0], info
        if scope.cancelled_caught:
            timeout = self._connect_timeout if phase == "connecting" else self._call_timeout
            log.info("MCP session to %s timed out %s", url, phase)
            raise _Failed(
                f"timed out after {timeout:g} s {phase}", connection=phase == "connecting"
            )
        assert errors is not None
        broken = errors.subgroup(is_connection_error) is not None
        what = "cannot connect" if phase == "connecting" else f"{phase} failed"
        broken = broken or phase == "connecting"
        log.info("MCP session to %s: %s: %s", url, what, describe(errors))
        raise _Failed(f"{what}: {summary(errors)}", connection=broken)


def _where(server: _Server | None, url: str) -> str:
    return f"MCP server {server.label if server else url!r}"
