"""Spawning and supervising actors in child processes.

`open_child` starts `python -m triode.actors` (or has the fork server named by
`$TRIODE_FORKSERVER` fork it: `forkserver.py`), runs the handshake (HELLO -> CONFIG -> READY),
watches the process through its pidfd so a death is noticed at once, and on leaving the block
stops the child with an escalation: SHUTDOWN message -> deadline -> SIGTERM -> SIGKILL.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import zmq

from triode.wire import (
    PROTOCOL_VERSION,
    Config,
    ControlMessage,
    Decoder,
    Encoder,
    Error,
    Hello,
    ProtocolError,
    Ready,
    Shutdown,
    Socket,
)

from .errors import ActorDied, HandshakeError, RemoteError
from .forkserver import ENV as forkserver_env
from .forkserver import ForkedProcess, fork_child

log = logging.getLogger(__name__)

CHILD_COMMAND = (sys.executable, "-m", "triode.actors")
# How long to wait for an ERROR that was sent just before the process exited.
_ERROR_GRACE = 0.25


class Child:
    """A running child actor process, as its parent sees it."""

    def __init__(self, name: str, process: trio.Process | ForkedProcess) -> None:
        self.name = name
        self.process = process
        self.ready: Ready | None = None
        self.error: RemoteError | ActorDied | None = None
        self.exited = trio.Event()
        self.stop_escalation: str | None = None  # "graceful", "terminated" or "killed"
        self._hello = trio.Event()
        self._ready = trio.Event()
        self._remote_error: Error | None = None
        self._error_received = trio.Event()
        self._hello_msg: Hello | None = None
        self._stopping = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def expect_exit(self) -> None:
        """The child was asked to leave by other means (a signal that drains it): its exit
        from now on is a stop, not a death."""
        self._stopping = True

    def _exit_error(self) -> ActorDied:
        if self._remote_error is not None:
            return RemoteError(self.name, self.returncode, self._remote_error)
        return ActorDied(self.name, self.returncode)


class RestartBudget:
    """How often a supervised child may die and be started again: at most `limit` deaths
    within `window` seconds (the engine cores' `--max-engine-restarts`, the API servers')."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self._deaths: deque[float] = deque()

    def allow(self) -> bool:
        """Count a death; whether the child may be started again."""
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.window:
            self._deaths.popleft()
        return self.count <= self.limit

    @property
    def count(self) -> int:
        """The deaths within the window, as of the last one."""
        return len(self._deaths)


@asynccontextmanager
async def open_child(
    target: str,
    *,
    name: str | None = None,
    addresses: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
    ready_timeout: float = 60.0,
    shutdown_timeout: float = 5.0,
    terminate_timeout: float = 2.0,
    raise_on_death: bool = True,
    command: Sequence[str] = CHILD_COMMAND,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Child]:
    """Start `target` (`"module:function"`) in a child process and supervise it.

    Returns once the child sent READY. If the child dies before that, or sends a bad or
    mismatched HELLO, or is not ready within `ready_timeout`, this raises (`RemoteError` with the
    child's traceback, `ActorDied`, `HandshakeError`, or `trio.TooSlowError`) inside an exception
    group. Afterwards a death is noticed at once: with `raise_on_death` it cancels the block and
    raises `ActorDied`/`RemoteError` out of it; otherwise `child.exited` is set and `child.error`
    says why. Leaving the block stops the child: SHUTDOWN, `shutdown_timeout`, SIGTERM,
    `terminate_timeout`, SIGKILL. `command` is the interpreter command that runs the child
    module (for wrappers such as numactl); `env` adds environment variables.
    """
    name = name or target.rpartition(":")[2]
    tmpdir = tempfile.mkdtemp(prefix="triode-")
    zctx = zmq.Context()
    tag = uuid.uuid4().hex[:8]
    up_address = f"ipc://{tmpdir}/{tag}-up"
    down_address = f"ipc://{tmpdir}/{tag}-down"
    up = Socket.open(zctx, zmq.PULL, bind=up_address)
    down = Socket.open(zctx, zmq.PUSH, bind=down_address)
    encoder = Encoder()
    try:
        argv = [up_address, down_address, target, name, str(os.getpid())]
        child_env = {**os.environ, **(env or {})}
        process: trio.Process | ForkedProcess | None = None
        forkserver = os.environ.get(forkserver_env)
        if forkserver and tuple(command) == CHILD_COMMAND:
            process = await fork_child(forkserver, argv, child_env)
        if process is None:
            process = await trio.lowlevel.open_process(
                [*command, *argv],
                env=child_env,
                start_new_session=True,  # terminal signals go to the parent, which stops us
                stdin=subprocess.DEVNULL,
            )
        child = Child(name, process)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_control, child, up)
                nursery.start_soon(_watch_process, child, raise_on_death)
                with trio.fail_after(ready_timeout):
                    await _handshake(child, down, encoder, addresses or {}, options or {})
                try:
                    yield child
                finally:
                    with trio.CancelScope(shield=True):
                        await _stop(child, down, encoder, shutdown_timeout, terminate_timeout)
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _reap(process)
    finally:
        up.close()
        down.close()
        zctx.term()
        shutil.rmtree(tmpdir, ignore_errors=True)


async def _handshake(
    child: Child,
    down: Socket,
    encoder: Encoder,
    addresses: Mapping[str, str],
    options: Mapping[str, Any],
) -> None:
    await child._hello.wait()
    hello = child._hello_msg
    assert hello is not None
    if hello.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"actor {child.name!r} speaks protocol version {hello.protocol_version}, "
            f"this process speaks {PROTOCOL_VERSION}: both sides must come from the same triode"
        )
    await down.send_multipart(encoder.encode(Config(dict(addresses), dict(options))))
    await child._ready.wait()


async def _read_control(child: Child, up: Socket) -> None:
    decoder: Decoder[ControlMessage] = Decoder(ControlMessage)  # type: ignore[arg-type]
    while True:
        try:
            msg = decoder.decode(await up.recv_multipart())
        except ProtocolError as e:
            log.warning("actor %r sent an undecodable control message: %s", child.name, e)
            continue
        if isinstance(msg, Hello) and not child._hello.is_set():
            child._hello_msg = msg
            child._hello.set()
        elif isinstance(msg, Ready) and child._hello.is_set() and not child._ready.is_set():
            child.ready = msg
            child._ready.set()
        elif isinstance(msg, Error):
            child._remote_error = msg
            child._error_received.set()
        else:
            log.warning("actor %r sent an unexpected %s", child.name, type(msg).__name__)


async def _watch_process(child: Child, raise_on_death: bool) -> None:
    await child.process.wait()
    if not child._stopping:
        with trio.move_on_after(_ERROR_GRACE):
            await child._error_received.wait()
        child.error = child._exit_error()
    child.exited.set()
    if child._stopping:
        return
    if child._ready.is_set():
        log.error("%s", child.error)
    else:
        # a start that failed is raised below, whole: its caller reports it
        log.debug("%s", child.error)
    if raise_on_death or not child._ready.is_set():
        assert child.error is not None
        raise child.error


async def _stop(
    child: Child, down: Socket, encoder: Encoder, shutdown_timeout: float, terminate_timeout: float
) -> None:
    """Stop the child: message, deadline, SIGTERM, deadline, SIGKILL."""
    child._stopping = True
    process = child.process
    if process.returncode is not None:
        return
    with trio.move_on_after(min(shutdown_timeout, 1.0)):
        await down.send_multipart(encoder.encode(Shutdown()))
    with trio.move_on_after(shutdown_timeout):
        await process.wait()
        child.stop_escalation = "graceful"
        return
    log.warning("actor %r ignored SHUTDOWN for %.1fs; terminating", child.name, shutdown_timeout)
    _signal(process, signal.SIGTERM)
    with trio.move_on_after(terminate_timeout):
        await process.wait()
        child.stop_escalation = "terminated"
        return
    log.warning("actor %r ignored SIGTERM for %.1fs; killing", child.name, terminate_timeout)
    _signal(process, signal.SIGKILL)
    await process.wait()
    child.stop_escalation = "killed"


async def _reap(process: trio.Process | ForkedProcess) -> None:
    if process.returncode is None:
        _signal(process, signal.SIGKILL)
    await process.wait()


def _signal(process: trio.Process | ForkedProcess, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass
