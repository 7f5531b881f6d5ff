"""`triode serve` as a child process: its command line, starting it and waiting until it answers
`/health`, and stopping it with whatever of its process group is left.

The benchmarks, the live fuzzer and tests run a server through this; `serve.py` holds the
`triode bench serve` benchmark itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO

import httpx
import trio


def serve_command(
    model: str | None, port: int, *, dtype: str | None = None, max_num_seqs: int | None = None
) -> list[str]:
    """The `triode serve` command line for `model` (None: the default model) on `port`."""
    command = [sys.executable, "-m", "triode.edge.cli", "serve"]
    command += [] if model is None else [model]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += [] if dtype is None else ["--dtype", dtype]
    command += [] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]
    return command


@asynccontextmanager
async def open_server(
    command: list[str],
    base_url: str,
    *,
    ready_timeout: float = 300.0,
    stop_timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> AsyncIterator[trio.Process]:
    """Run the server `command` until `GET {base_url}/health` answers 200, then yield it.

    The server runs in a process group of its own. Leaving the block sends it SIGINT, waits
    `stop_timeout` seconds for it to drain and exit, then kills it and whatever of its group is
    left (a server's children that outlived it). Raises `RuntimeError` (with the end of the
    server's output) if it exits before it is ready and `TimeoutError` if it is not ready within
    `ready_timeout` seconds. `env` adds environment variables.
    """
    with tempfile.TemporaryFile() as log:
        process = await trio.lowlevel.open_process(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            await wait_until_healthy(process, base_url, ready_timeout, log)
            yield process
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process, stop_timeout)


async def wait_until_healthy(
    process: trio.Process, base_url: str, within: float, log: IO[bytes], poll: float = 0.5
) -> None:
    """Until `/health` answers 200, polled every `poll` seconds; RuntimeError with the log's
    tail where the process exits first, TimeoutError after `within` seconds."""
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as client:
        with trio.move_on_after(within):
            while process.returncode is None:
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                await trio.sleep(poll)
            raise RuntimeError(
                f"the server exited with status {process.returncode} before it was ready:\n"
                + _tail(log)
            )
    raise TimeoutError(f"the server was not ready after {within:g} s:\n" + _tail(log))


def _tail(log: IO[bytes], size: int = 4000) -> str:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - size))
    return log.read().decode(errors="replace")


async def _stop(process: trio.Process, grace: float) -> None:
    process.send_signal(signal.SIGINT)
    with trio.move_on_after(grace):
        await process.wait()
        # and its children, which may outlive it by their own clean-up (shared memory, ...)
        while group_alive(process.pid):  # noqa: ASYNC110 - other processes: we can only poll
            await trio.sleep(0.1)
    if process.returncode is None:
        process.kill()
        await process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the group is the server's: it leads it
    except ProcessLookupError:
        pass  # nothing of it is left


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
