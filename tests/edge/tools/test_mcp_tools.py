"""`ToolServers` against real MCP servers (`tests/mcp_server.py` processes) on loopback."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp.types import Tool
from mcp_server import MCPServerProcess, Transport, free_port, kill, running_mcp_server

from triode.edge.tools import destinations
from triode.edge.tools.destinations import refusal
from triode.edge.tools.mcp import (
    ToolServerError,
    ToolServers,
    ToolServerUnavailable,
    parse_tool_server_specs,
)
from triode.edge.tools.mcp_answers import (
    MAX_DESCRIPTION,
    MAX_OUTPUT_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_TOOLS,
    offered_tools,
)

TOOLS = {"add", "get_weather", "slow", "fail"}
SERVER_NAME = "triode-test-tools"


def assert_gone(server: MCPServerProcess) -> None:
    assert server.process.returncode is not None, f"the MCP server {server.pid} still runs"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, MCPServerProcess]]:
    """One server per transport for the module."""
    tmp = tmp_path_factory.mktemp("mcp")
    with running_mcp_server(tmp, "sse") as sse, running_mcp_server(tmp, "streamable-http") as http:
        yield {"sse": sse, "streamable-http": http}
    assert_gone(sse)
    assert_gone(http)


@pytest.fixture(params=["sse", "streamable-http"])
def server(
    request: pytest.FixtureRequest, servers: dict[str, MCPServerProcess]
) -> MCPServerProcess:
    return servers[request.param]


async def started(
    *specs: str,
    call_timeout: float = 30.0,
    connect_timeout: float = 10.0,
    allow_request_servers: bool = False,
    allow_private_servers: bool = False,
) -> ToolServers:
    tool_servers = ToolServers(
        list(specs),
        call_timeout=call_timeout,
        connect_timeout=connect_timeout,
        allow_request_servers=allow_request_servers,
        allow_private_servers=allow_private_servers,
    )
    await tool_servers.start()
    return tool_servers


async def test_both_transports_list_the_four_tools_with_their_schemas(
    server: MCPServerProcess,
) -> None:
    tool_servers = await started(f"tools={server.url}")
    tools = {t.name: t for t in await tool_servers.list_tools("tools")}
    assert set(tools) == TOOLS
    assert tools["add"].description == "Add two integers"
    add = tools["add"].input_schema
    assert add["type"] == "object" and add["required"] == ["a", "b"]
    assert add["properties"]["a"]["type"] == "integer"
    assert tools["get_weather"].input_schema["properties"]["city"]["type"] == "string"


async def test_an_unlabelled_server_is_labelled_by_its_server_info_name(
    server: MCPServerProcess,
) -> None:
    tool_servers = await started(server.url)
    assert tool_servers.labels() == [SERVER_NAME]
    assert {t.name for t in await tool_servers.list_tools(server.url.split("/")[2])} == TOOLS


async def test_a_call_returns_the_tool_text_and_the_server_records_it(
    server: MCPServerProcess,
) -> None:
    tool_servers = await started(f"tools={server.url}")
    result = await tool_servers.call("tools", "add", {"a": 2, "b": 3})
    assert (result.output, result.error) == ("5", None)
    assert server.calls()[-1] == {"tool": "add", "arguments": {"a": 2, "b": 3}}
    weather = await tool_servers.call("tools", "get_weather", {"city": "Oslo"})
    assert weather.output == "Sunny, 21 C in Oslo"


async def test_a_tool_that_raises_is_an_error_result(server: MCPServerProcess) -> None:
    tool_servers = await started(f"tools={server.url}")
    result = await tool_servers.call("tools", "fail", {"message": "no such city"})
    assert result.output == ""
    assert result.error is not None and "no such city" in result.error


async def test_bad_arguments_are_an_error_result(server: MCPServerProcess) -> None:
    tool_servers = await started(f"tools={server.url}")
    result = await tool_servers.call("tools", "add", {"a": "two"})
    assert result.output == "" and result.error is not None and "add" in result.error
    unknown = await tool_servers.call("tools", "no_such_tool", {})
    assert unknown.error is not None and "no_such_tool" in unknown.error


async def test_a_call_past_the_call_timeout_is_an_error_returned_promptly(
    server: MCPServerProcess,
) -> None:
    tool_servers = await started(f"tools={server.url}", call_timeout=0.5)
    began = trio.current_time()
    result = await tool_servers.call("tools", "slow", {"seconds": 10})
    assert trio.current_time() - began < 3
    assert result.output == ""
    assert result.error is not None and "timed out after 0.5 s" in result.error
    # the timeout cost the call only: the server still answers the next one
    assert (await tool_servers.call("tools", "add", {"a": 1, "b": 1})).output == "2"


@pytest.mark.parametrize("transport", ["sse", "streamable-http"])
async def test_a_server_down_at_start_is_listed_once_it_comes_up(
    tmp_path: Path, transport: Transport
) -> None:
    port = free_port()
    path = "/sse" if transport == "sse" else "/mcp"
    tool_servers = await started(f"http://127.0.0.1:{port}{path}", connect_timeout=2)
    assert tool_servers.labels() == [f"127_0_0_1_{port}"]
    with pytest.raises(ToolServerUnavailable, match="cannot connect"):
        await tool_servers.list_tools(f"127.0.0.1:{port}")
    down = await tool_servers.call(f"127.0.0.1:{port}", "add", {"a": 1, "b": 2})
    assert down.error == f"MCP server '127_0_0_1_{port}': cannot connect: connection refused"
    with running_mcp_server(tmp_path, transport, port=port) as up:
        tools = await tool_servers.list_tools(f"127.0.0.1:{port}")
        assert {t.name for t in tools} == TOOLS
        assert tool_servers.labels() == [SERVER_NAME]
        assert (await tool_servers.call(SERVER_NAME, "add", {"a": 1, "b": 2})).output == "3"
    assert_gone(up)


@pytest.mark.parametrize("transport", ["sse", "streamable-http"])
async def test_a_server_killed_mid_run_gives_error_results(
    tmp_path: Path, transport: Transport
) -> None:
    with running_mcp_server(tmp_path, transport) as doomed:
        tool_servers = await started(f"doomed={doomed.url}", connect_timeout=2, call_timeout=10)
        began = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def kill_soon() -> None:
                await trio.sleep(0.5)
                os.kill(doomed.pid, signal.SIGKILL)

            nursery.start_soon(kill_soon)
            during = await tool_servers.call("doomed", "slow", {"seconds": 5})
        assert trio.current_time() - began < 4
        assert during.output == "" and during.error is not None
        doomed.process.wait()
        after = await tool_servers.call("doomed", "add", {"a": 1, "b": 2})
        assert after.output == "" and after.error is not None and "cannot connect" in after.error
        with pytest.raises(ToolServerUnavailable):
            await tool_servers.list_tools("doomed")
        kill(doomed)
    assert_gone(doomed)


async def test_a_request_server_url_is_refused_unless_allowed(
    servers: dict[str, MCPServerProcess],
) -> None:
    url = servers["streamable-http"].url
    strict = await started()
    with pytest.raises(ToolServerError, match="not a configured tool server"):
        await strict.list_tools("mine", server_url=url)
    with pytest.raises(ToolServerError, match="not a configured tool server"):
        await strict.call("mine", "add", {"a": 1, "b": 2}, server_url=url)
    with pytest.raises(ToolServerError) as refused:
        await strict.list_tools("mine", server_url=url)
    assert not isinstance(refused.value, ToolServerUnavailable)

    lenient = await started(allow_request_servers=True, allow_private_servers=True)
    assert {t.name for t in await lenient.list_tools("mine", server_url=url)} == TOOLS
    assert (await lenient.call("mine", "add", {"a": 4, "b": 5}, server_url=url)).output == "9"
    with pytest.raises(ToolServerError, match="http:// or https://"):
        await lenient.list_tools("mine", server_url="file:///etc/passwd")
    gone = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(ToolServerUnavailable):
        await lenient.list_tools("gone", server_url=gone)


async def test_a_configured_server_may_be_named_by_its_url(
    servers: dict[str, MCPServerProcess],
) -> None:
    url = servers["sse"].url
    tool_servers = await started(f"tools={url}")
    assert {t.name for t in await tool_servers.list_tools("other", server_url=url)} == TOOLS
    assert {t.name for t in await tool_servers.list_tools(url)} == TOOLS


async def test_an_unknown_label_is_refused(servers: dict[str, MCPServerProcess]) -> None:
    tool_servers = await started(f"tools={servers['sse'].url}")
    with pytest.raises(ToolServerError, match="unknown tool server 'nope'") as refused:
        await tool_servers.list_tools("nope")
    assert not isinstance(refused.value, ToolServerUnavailable)
    with pytest.raises(ToolServerError, match="unknown tool server"):
        await tool_servers.call("nope", "add", {"a": 1, "b": 2})
    with pytest.raises(ToolServerError):
        await tool_servers.list_tools(None)


@pytest.mark.parametrize(
    ("value", "specs"),
    [
        ("", []),
        ("http://h:1/sse", ["http://h:1/sse"]),
        ("localhost:8001", ["http://localhost:8001/sse"]),
        ("web=https://example.com/mcp", ["web=https://example.com/mcp"]),
        ("a=h:2, http://h:3/mcp?x=1 ,", ["a=http://h:2/sse", "http://h:3/mcp?x=1"]),
    ],
)
def test_parse_tool_server_specs(value: str, specs: list[str]) -> None:
    assert parse_tool_server_specs(value) == specs


@pytest.mark.parametrize(
    "value",
    ["ftp://h/x", "file:///tmp/x", "ws://h:1/sse", "label=ftp://h/x", "just-a-name", "http://"],
)
def test_parse_tool_server_specs_refuses_what_is_not_http(value: str) -> None:
    with pytest.raises(ValueError, match=r"http://|no host|not a valid URL"):
        parse_tool_server_specs(value)


def test_two_servers_with_one_label_are_refused() -> None:
    with pytest.raises(ValueError, match="labelled 'x'"):
        ToolServers(["x=http://h:1/sse", "x=http://h:2/sse"])


def test_a_refused_scheme_fails_construction() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        ToolServers(["stdio://server"])


# Request-named servers: where they may be, and what they may send


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "a loopback address"),
        ("localhost", "a loopback address"),
        ("[::1]", "a loopback address"),
        ("[::ffff:127.0.0.1]", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("192.168.0.1", "a private address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("[fd00:ec2::254]", "a cloud metadata address"),
        ("169.254.1.1", "a link-local address"),
        ("[fe80::1]", "a link-local address"),
        ("224.0.0.251", "a multicast address"),
        ("0.0.0.0", "the unspecified address"),
        ("100.64.0.1", "not a public address"),
        ("[64:ff9b::a00:1]", "a private address"),
        ("[2002:7f00:1::]", "a loopback address"),
    ],
)
async def test_a_request_server_url_at_a_private_address_is_refused(host: str, reason: str) -> None:
    # Who can name one: any key holder, once --allow-request-tool-servers is on; what it would
    # cost: a connection from this host to anything it can reach. Refused before connecting.
    tool_servers = await started(allow_request_servers=True)
    url = f"http://{host}:8000/mcp"

    with pytest.raises(ToolServerError, match=reason) as refused:
        await tool_servers.list_tools("x", server_url=url)
    assert not isinstance(refused.value, ToolServerUnavailable)
    with pytest.raises(ToolServerError, match=reason):
        await tool_servers.call("x", "add", {}, server_url=url)


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert refusal(ip_address(address)) is None


async def test_the_address_connected_is_the_one_checked(
    servers: dict[str, MCPServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    # DNS rebinding: the name is public when checked, loopback a moment later when connected
    server = servers["streamable-http"]
    answers = itertools.cycle([[ip_address("93.184.216.34")], [ip_address("127.0.0.1")]])

    async def resolve(host: str, port: int) -> list[Any]:
        return next(answers)

    monkeypatch.setattr(destinations, "_resolve", resolve)
    tool_servers = await started(allow_request_servers=True, connect_timeout=5)
    url = server.url.replace("127.0.0.1", "rebinding.example")
    before = len(server.calls())

    with pytest.raises(ToolServerUnavailable, match=r"resolves to 127\.0\.0\.1, a loopback"):
        await tool_servers.list_tools("x", server_url=url)
    result = await tool_servers.call("x", "add", {"a": 1, "b": 2}, server_url=url)

    assert result.error is not None and "a loopback address" in result.error
    assert len(server.calls()) == before


async def _answer_once(
    response: bytes, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """An HTTP server on loopback that answers every request with `response`."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])

    async def answer(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.receive_some(65536)
            await stream.send_all(response)
        await stream.aclose()

    await trio.serve_listeners(answer, listeners)


@pytest.mark.parametrize("path", ["/mcp", "/sse"])
async def test_a_servers_error_page_is_summarised_not_echoed(path: str) -> None:
    page = b"SECRET stack trace at /srv/app/server.py line 3"
    response = (
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/html\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(page), page)
    )
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_answer_once, response)
        url = f"http://127.0.0.1:{port}{path}"
        tool_servers = await started(f"tools={url}", connect_timeout=5)

        with pytest.raises(ToolServerUnavailable) as down:
            await tool_servers.list_tools("tools")
        called = await tool_servers.call("tools", "add", {"a": 1})
        nursery.cancel_scope.cancel()

    # neither the page nor where the operator's server is (its address) reaches the client
    for message in (str(down.value), called.error or ""):
        assert message.startswith("MCP server 'tools': cannot connect: ")
        assert "SECRET" not in message and "/srv/" not in message and str(port) not in message
        assert "HTTP 500" in message or "MCP error -32603" in message


async def test_a_tools_output_is_cut(server: MCPServerProcess) -> None:
    tool_servers = await started(f"tools={server.url}")

    result = await tool_servers.call("tools", "get_weather", {"city": "x" * (300 << 10)})

    assert result.error is None
    assert len(result.output) < MAX_OUTPUT_CHARS + 100 and "[cut:" in result.output


async def test_an_answer_past_the_byte_cap_is_a_failure(
    servers: dict[str, MCPServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --allow-private-tool-servers any key holder may make this server talk to whatever
    # it can reach; the most one answer costs is MAX_RESPONSE_BYTES read (16 MiB), and what
    # stays is MAX_OUTPUT_CHARS of a tool's output or MAX_TOOLS tools of a listing.
    monkeypatch.setattr(destinations, "MAX_RESPONSE_BYTES", 256)
    url = servers["streamable-http"].url
    tool_servers = await started(allow_request_servers=True, allow_private_servers=True)

    with pytest.raises(ToolServerUnavailable):
        await tool_servers.list_tools("x", server_url=url)


def test_a_listing_offers_at_most_max_tools_with_sane_names_and_schemas() -> None:
    def tool(name: str, schema: dict[str, Any] | None = None, description: str = "") -> Tool:
        return Tool(name=name, description=description,
                    input_schema=schema or {"type": "object"})  # fmt: skip

    listed = [tool(f"t{i}") for i in range(MAX_TOOLS + 10)]
    listed[0] = tool("bad name!")
    listed[1] = tool("big", {"type": "object", "description": "x" * MAX_SCHEMA_BYTES})
    listed[2] = tool("wordy", description="d" * 5000)

    offered = offered_tools("http://h/mcp", listed)

    assert len(offered) == MAX_TOOLS
    names = [t.name for t in offered]
    assert "bad name!" not in names and "big" not in names
    assert len(offered[0].description or "") < MAX_DESCRIPTION + 50


def test_a_server_without_mcp_tool_servers_never_loads_the_sdk() -> None:
    """The MCP SDK (over half a second to import) loads with the first MCP operation: the API
    server's modules and `triode serve` start without it."""
    import subprocess
    import sys

    code = (
        "import sys, triode.edge.app, triode.edge.commands.serve, triode.edge.tools.mcp; "
        "assert 'mcp' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mcp'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
