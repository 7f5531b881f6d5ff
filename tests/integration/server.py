"""A real `triode serve` process on a free loopback port, for tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from triode.edge.sse import SSEParser
from triode.wire.ports import free_port

START_TIMEOUT = 180.0


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log: Path

    def engine_pid(self) -> int:
        """The engine core, as the server's log names it once ready (a fork server's child, or
        the server's only child process)."""
        [pid] = re.findall(r"\(engine core pid (\d+)\)", self.output())
        return int(pid)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def restarted_engine_pid(self, restart: int, timeout: float = 120.0) -> int:
        """The engine core started in a dead one's place for `restart` (1 for the first), as
        the server's log names it once it is READY."""
        pattern = rf"started again in .* \(pid (\d+), restart {restart}\)"
        deadline = time.monotonic() + timeout
        while not (found := re.findall(pattern, self.output())):
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        return int(found[0])


def idle(server: Server, timeout: float = 10.0) -> bool:
    """Whether the server's engine comes to run nothing with an empty KV cache within
    `timeout` seconds, as its /metrics say."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        values = {
            line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("triode:") and "{" in line
        }
        if values["triode:num_requests_running"] == 0 and values["triode:kv_cache_usage_perc"] == 0:
            return True
        time.sleep(0.1)
    return False


def stream_and_kill(server: Server, pid: int) -> tuple[list[bytes], float]:
    """Start a long streamed completion, SIGKILL `pid` once its first chunk arrived, and read
    the stream to its end: (its SSE events, seconds from the kill to the end)."""
    body = {"prompt": "Count to a thousand:", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        parser = SSEParser()
        stream = response.iter_bytes()
        events = parser.feed(next(stream))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for chunk in stream:
            events += parser.feed(chunk)
        return events, time.monotonic() - killed


@contextlib.contextmanager
def running_server(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """Start `triode serve ARGS --port P`, wait for /health, stop it (SIGINT) on exit."""
    with running_servers((args, log, env)) as [server]:
        yield server


@contextlib.contextmanager
def running_servers(
    *specs: tuple[list[str], Path, dict[str, str] | None],
) -> Iterator[list[Server]]:
    """Several `running_server`s (ARGS, LOG, ENV each), started together so that their
    start-ups overlap, then each waited for; all stopped on exit."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_started(*spec)) for spec in specs]
        for server in servers:
            _wait_healthy(server)
        yield servers


@contextlib.contextmanager
def _started(args: list[str], log: Path, env: dict[str, str] | None) -> Iterator[Server]:
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        yield Server(process, f"http://127.0.0.1:{port}", log)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(server: Server) -> None:
    wait_for_health(server.process, server.url, server.log, START_TIMEOUT)


def _read(log: Path) -> str:
    return log.read_text(errors="replace")


def wait_for_health(
    process: subprocess.Popen[bytes], url: str, log: Path, within: float, poll: float = 0.2
) -> None:
    """Until `GET {url}/health` answers 200: RuntimeError (with the log) if `process` exits
    first, TimeoutError after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited early:\n{_read(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.args!r} did not come up:\n{_read(log)}")
        time.sleep(poll)
