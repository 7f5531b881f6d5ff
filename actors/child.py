"""The child side of an actor process: `python -m triode.actors UP DOWN TARGET NAME PPID`.

It connects the two control sockets, says HELLO, takes CONFIG, and runs TARGET
(`"module:function"`, an `async def f(ctx: ChildContext)`). SHUTDOWN from the parent cancels the
target; an exception from the target goes back to the parent as a wire `Error` with its traceback,
and the process exits 1.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Awaitable, Callable
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

from .errors import exception_leaves

log = logging.getLogger(__name__)

CONFIG_TIMEOUT = 30.0
# Long enough for a final ERROR to leave before the process exits.
CONTROL_LINGER_MS = 2000
_PARENT_POLL = 0.5


class ChildContext:
    """What a child actor's target receives: its configuration and its line to the parent."""

    def __init__(
        self, name: str, config: Config, zmq_context: zmq.Context, up: Socket, encoder: Encoder
    ) -> None:
        self.name = name
        self.addresses: dict[str, str] = config.addresses
        self.options: dict[str, Any] = config.options
        self.zmq_context = zmq_context
        self.shutdown_requested = trio.Event()
        self._up = up
        self._encoder = encoder
        self.said_ready = False

    async def ready(self, ready: Ready | None = None) -> None:
        """Tell the parent this actor is serving. Call once, after binding/connecting sockets."""
        await self._up.send_multipart(self._encoder.encode(ready or Ready()))
        self.said_ready = True


def resolve(target: str) -> Callable[[ChildContext], Awaitable[None]]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target must look like 'package.module:function', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


async def serve_child(
    up_address: str, down_address: str, target: str, name: str, parent_pid: int
) -> int:
    """Run one child actor to completion; return the process exit code."""
    zctx = zmq.Context()
    encoder = Encoder()
    up = Socket.open(zctx, zmq.PUSH, connect=up_address, linger=CONTROL_LINGER_MS)
    down = Socket.open(zctx, zmq.PULL, connect=down_address)
    ctx: ChildContext | None = None
    try:
        await up.send_multipart(encoder.encode(Hello(PROTOCOL_VERSION, os.getpid(), name)))
        decoder: Decoder[ControlMessage] = Decoder(ControlMessage)  # type: ignore[arg-type]
        with trio.fail_after(CONFIG_TIMEOUT):
            config = decoder.decode(await down.recv_multipart())
        if not isinstance(config, Config):
            raise ProtocolError(f"expected CONFIG from the parent, got {type(config).__name__}")
        ctx = ChildContext(name, config, zctx, up, encoder)
        main = resolve(target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_parent, down, decoder, ctx, nursery.cancel_scope)
            nursery.start_soon(_exit_with_parent, parent_pid, name)
            await main(ctx)
            nursery.cancel_scope.cancel()
        return 0
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await up.send_multipart(encoder.encode(_box(exc)))
        if ctx is not None and ctx.said_ready:
            log.exception("actor %r failed", name)
        else:
            # a start that failed: the parent raises it with this traceback, and its caller
            # decides how much of it to show (`triode serve`: one line)
            log.debug("actor %r failed before READY", name, exc_info=True)
        return 1
    finally:
        down.close()
        up.close()  # lingers, so a final ERROR still leaves
        zctx.term()


async def _watch_parent(
    down: Socket, decoder: Decoder[Any], ctx: ChildContext, scope: trio.CancelScope
) -> None:
    while True:
        try:
            msg = decoder.decode(await down.recv_multipart())
        except ProtocolError as e:
            log.warning("ignored an undecodable control message: %s", e)
            continue
        if isinstance(msg, Shutdown):
            ctx.shutdown_requested.set()
            scope.cancel()
            return


def _box(exc: BaseException) -> Error:
    error = Error.from_exception(exc)
    if isinstance(exc, BaseExceptionGroup):
        leaves = exception_leaves(exc)
        if len(leaves) == 1:
            error.type_name, error.message = type(leaves[0]).__qualname__, str(leaves[0])
        else:
            error.message = "; ".join(f"{type(e).__qualname__}: {e}" for e in leaves)
    return error


async def _exit_with_parent(parent_pid: int, name: str) -> None:
    """An orphaned actor has no one to serve: leave when the parent process is gone."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        while os.getppid() == parent_pid:  # noqa: ASYNC110 - nothing to wait on but time
            await trio.sleep(_PARENT_POLL)
    else:
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
    log.error("actor %r: parent %d is gone; exiting", name, parent_pid)
    os._exit(1)


def name_process(name: str) -> None:
    """The actor's name as its process's (`/proc/PID/comm`: what ps, top and pgrep show, and
    the same whether the process was executed or forked): 15 bytes at most, Linux only."""
    try:
        with open("/proc/self/comm", "wb") as comm:
            comm.write(name.encode()[:15])
    except OSError:
        pass


def main(argv: list[str], *, forked: bool = False) -> int:
    """`forked`: a fork server started this process for `parent_pid` (see `forkserver`)."""
    up_address, down_address, target, name, parent_pid = argv
    if not forked and os.getppid() != int(parent_pid):
        return 1  # the parent died before we started
    name_process(name)
    logging.basicConfig(
        level=os.environ.get("TRIODE_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    return trio.run(serve_child, up_address, down_address, target, name, int(parent_pid))
