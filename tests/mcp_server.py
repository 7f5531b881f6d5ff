"""A small MCP server for tests, run as a process, and the helper that runs it.

`python tests/mcp_server.py --port P --transport sse|streamable-http --log FILE` serves four tools
(`add`, `get_weather`, `slow`, `fail`) on 127.0.0.1:P, at `/sse` or at `/mcp`; every call appends
one JSON line `{"tool": name, "arguments": {...}}` to FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from triode.wire.ports import free_port

START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0

Transport = Literal["sse", "streamable-http"]
PATHS: dict[str, str] = {"sse": "/sse", "streamable-http": "/mcp"}


def serve(port: int, transport: Transport, log: Path) -> None:
    """Run the server until the process is signalled."""
    import anyio
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("triode-test-tools", log_level="WARNING")

    def record(tool: str, arguments: dict[str, Any]) -> None:
        with log.open("a") as f:
            f.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")
            f.flush()

    @server.tool(description="Add two integers")
    def add(a: int, b: int) -> int:
        record("add", {"a": a, "b": b})
        return a + b

    @server.tool(description="The current weather in a city")
    def get_weather(city: str) -> str:
        record("get_weather", {"city": city})
        return f"Sunny, 21 C in {city}"

    @server.tool(description="Sleep for some seconds, then answer 'done'")
    async def slow(seconds: float) -> str:
        record("slow", {"seconds": seconds})
        await anyio.sleep(seconds)
        return "done"

    @server.tool(description="Always fail with the given message")
    def fail(message: str) -> str:
        record("fail", {"message": message})
        raise ToolError(message)

    if transport == "sse":
        server.run("sse", host="127.0.0.1", port=port)
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)


@dataclass
class MCPServerProcess:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT/sse or http://127.0.0.1:PORT/mcp
    log: Path
    output: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def calls(self) -> list[dict[str, Any]]:
        """The calls the server recorded, oldest first."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]

    def running(self) -> bool:
        return self.process.poll() is None


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def running_mcp_server(
    tmp_path: Path, transport: Transport = "sse", *, port: int | None = None
) -> Iterator[MCPServerProcess]:
    """Start this server on `port` (a free one if None), wait until the port answers, and on
    exit stop it (SIGTERM, then SIGKILL past a deadline) and reap it."""
    port = port or free_port()
    directory = tmp_path / f"mcp-{transport}-{port}-{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    log, output = directory / "calls.jsonl", directory / "output.log"
    args = ["--port", str(port), "--transport", transport, "--log", str(log)]
    with output.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, __file__, *args], stdout=out, stderr=subprocess.STDOUT
        )
    server = MCPServerProcess(process, f"http://127.0.0.1:{port}{PATHS[transport]}", log, output)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers(port):
            if process.poll() is not None:
                raise RuntimeError(f"the MCP server exited early:\n{output.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the MCP server did not listen on {port} in {START_TIMEOUT} s")
            time.sleep(0.05)
        yield server
    finally:
        stop(server)


def stop(server: MCPServerProcess) -> None:
    """Stop the server (SIGTERM, SIGKILL past a deadline) and reap it; a no-op once reaped."""
    if server.process.poll() is None:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.process.wait()


def kill(server: MCPServerProcess) -> None:
    """SIGKILL the server and reap it, as a crash would leave it."""
    if server.process.poll() is None:
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--transport", choices=sorted(PATHS), default="sse")
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    serve(args.port, args.transport, args.log)


if __name__ == "__main__":
    main()
