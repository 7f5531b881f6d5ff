"""hypercorn under trio for triode's ASGI apps: `triode serve`'s app (one process or several API
server processes) and `triode proxy`'s.

`serve_asgi` binds (or takes a shared listening socket), reports the bound URLs, and drains on
the first SIGINT/SIGTERM; hypercorn's per-connection handler is replaced by one that a single
connection's failure cannot take the whole server down with.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("triode.serve")
# Connections the kernel queues for accept: a burst of clients connecting at once (hypercorn's
# default of 100 overflows at a few hundred, and each dropped SYN costs its client a second or
# more). The kernel caps it at net.core.somaxconn.
BACKLOG = 4096


async def serve_asgi(
    app: Any,
    *,
    host: str,
    port: int,
    graceful_timeout: float,
    root_path: str = "",
    announce: Callable[[str], None] = lambda url: None,
    fd: int | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` in hypercorn's trio worker until SIGINT/SIGTERM (see
    `_on_signals`) or cancellation; `announce(url)` for each bound URL, which `task_status`
    gets too. With `fd`, serve on that listening socket (one that several API server
    processes share) instead of binding `host` and `port`."""
    config = Config()
    config.bind = [f"fd://{fd}" if fd is not None else f"{_host(host)}:{port}"]
    config.root_path = root_path
    config.graceful_timeout = graceful_timeout
    config.backlog = BACKLOG
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:

        async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                app,
                config,
                shutdown_trigger=shutdown.wait,  # type: ignore[arg-type]
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # drained: stop watching for signals

        nursery.start_soon(_on_signals, shutdown, nursery.cancel_scope)
        binds = await nursery.start(run_server)
        for url in binds:
            announce(url)
        task_status.started(binds)


async def _on_signals(shutdown: trio.Event, scope: trio.CancelScope) -> None:
    """The first SIGINT/SIGTERM drains; a second one stops at once: a SIGINT as an interrupt
    (KeyboardInterrupt, which the commands turn into exit status 130, as a shell does), a
    SIGTERM by ending the server as a drain would."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if shutdown.is_set():
                log.warning("%s again: stopping without waiting for requests", name)
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                scope.cancel()
                return
            log.info("%s: finishing in-flight requests, then shutting down", name)
            shutdown.set()


class _ConnectionServer(TCPServer):
    """hypercorn's per-connection handler, kept from taking the whole server down.

    hypercorn runs every connection in the server's own nursery, so any exception that leaves
    a handler stops the server. One did, on request: a client that half-closes while its
    request is refused races hypercorn's close (an EOF sent outside its send lock) against the
    response, and the send that loses raises `trio.BusyResourceError`. Such a send is treated
    like one to a closed connection, which it is; any other failure drops its connection,
    logged, and the others and the server carry on.
    """

    async def protocol_send(self, event: Event) -> None:
        stream = self.stream
        if (
            isinstance(event, RawData)
            and isinstance(stream, trio.SocketStream)  # not TLS: the bytes go as they are
            and not self.send_lock.locked()
        ):
            # A streamed chunk almost always fits the socket's buffer: written here at once,
            # it skips the lock, shielded cancel scope and two checkpoints of hypercorn's
            # send (about a fifth of the server's time per SSE chunk). No other send is under way
            # (the lock is free) and nothing here yields, so nothing can come between. What
            # the socket does not take (or an error) goes the usual way.
            sent = _send_now(stream.socket.fileno(), event.data)
            if sent == len(event.data):
                return
            event = RawData(data=event.data[sent:])
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    async def run(self) -> None:
        try:
            await super().run()
        except* Exception as group:
            log.error("dropped a connection after a server error", exc_info=group)


def _send_now(fd: int, data: bytes) -> int:
    """How much of `data` the non-blocking socket `fd` took at once: 0 where it would block or
    failed (the usual send then meets the same and reports it)."""
    try:
        return os.write(fd, data)
    except OSError:
        return 0


hypercorn_run.TCPServer = _ConnectionServer  # type: ignore[misc]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
