"""`ToolServers` against real MCP servers (`tests/mcp_server.py` processes) on loopback."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from mcp_server import MCPServerProcess, Transport, free_port, kill, running_mcp_server

from triode.edge.mcp_tools import (
    ToolServerError,
    ToolServers,
    ToolServerUnavailable,
    parse_tool_server_specs,
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
) -> ToolServers:
    tool_servers = ToolServers(
        list(specs),
        call_timeout=call_timeout,
        connect_timeout=connect_timeout,
        allow_request_servers=allow_request_servers,
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
    assert down.output == "" and down.error is not None and "cannot connect" in down.error
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

    lenient = await started(allow_request_servers=True)
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
