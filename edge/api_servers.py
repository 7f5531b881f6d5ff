"""`triode serve --api-server-count N`: N API server processes on one port, over the same
engine cores.

The parent reserves the port (a socket bound with SO_REUSEPORT that never listens), starts the
engine cores (`open_engine_cores`), then N API server processes that each listen on the same
port with SO_REUSEPORT: the kernel spreads new connections over them by a hash of the
connection's addresses, so a burst of connections does not all land in the process that woke
first, as it would from one shared socket. API server `i` is
client `i` of every engine core: its requests carry that index and its SUB socket takes only
that topic, so each edge receives only its own requests' outputs. Requests are balanced over
the engine cores by each edge (`Engine`), by the queue lengths the engines publish.

Supervision: a dead API server is noticed at once through its pidfd. The engine cores abort its
requests (its subscription ended), and the parent starts another with the same index, which
takes over the topic. One that dies again and again (`MAX_RESTARTS` within
`RESTART_WINDOW` seconds) fails the whole server rather than leave it half serving.
SIGINT/SIGTERM drains: every API server gets SIGTERM and finishes its in-flight requests within
the graceful timeout, then the engine cores stop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import msgspec
import trio
from prometheus_client import multiprocess

from triode.actors import (
    Child,
    ChildContext,
    EngineArgs,
    EngineCoreEndpoint,
    RestartBudget,
    connect_engine,
    open_child,
    open_engine_cores,
)

from .app import open_app
from .asgi_server import BACKLOG, serve_asgi
from .auth import ApiKeys
from .metrics import MULTIPROC_DIR_ENV
from .settings import Settings

log = logging.getLogger("triode.serve")

API_SERVER = "triode.edge.api_servers:serve_api_server"
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0
# what an API server gets beyond the graceful timeout to exit on its own before it is stopped
EXIT_GRACE = 5.0


class ApiServerOptions(msgspec.Struct, kw_only=True):
    """What the parent sends an API server process."""

    client_index: int
    host: str
    port: int
    endpoints: list[EngineCoreEndpoint]
    settings: dict[str, Any]
    api_key_digests: list[bytes]
    root_path: str = ""
    graceful_timeout: float = 10.0


def settings_to_builtins(settings: Settings) -> tuple[dict[str, Any], list[bytes]]:
    fields = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(settings)
        if f.name != "api_keys"
    }
    return fields, list(settings.api_keys.digests)


def settings_from_builtins(fields: dict[str, Any], digests: list[bytes]) -> Settings:
    return Settings(**fields, api_keys=ApiKeys.from_digests(digests))


async def serve_api_server(ctx: ChildContext) -> None:
    """An API server process's actor (`triode.edge.api_servers:serve_api_server`): connects
    to every engine core as client `client_index`, then serves the app on the inherited
    socket until SIGTERM (which drains) or SHUTDOWN."""
    options = msgspec.convert(ctx.options, ApiServerOptions)
    settings = settings_from_builtins(options.settings, options.api_key_digests)
    listener = bind_shared(options.host, options.port)
    listener.listen(BACKLOG)
    fd = listener.detach()  # hypercorn's from here on
    async with connect_engine(options.endpoints, client_index=options.client_index) as engine:
        async with open_app(engine, settings) as app:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    lambda task_status: serve_asgi(
                        app,
                        host="",
                        port=0,
                        fd=fd,
                        root_path=options.root_path,
                        graceful_timeout=options.graceful_timeout,
                        task_status=task_status,
                    )
                )
                await ctx.ready()


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` with SO_REUSEPORT, not listening yet: the parent's
    reserves the port (and finds a free one for port 0), each API server's listens."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_api_servers(
    *,
    model: str | None,
    engine_args: dict[str, Any],
    settings: Settings,
    count: int,
    host: str,
    port: int,
    root_path: str = "",
    graceful_timeout: float = 10.0,
    announce: Callable[[str], None] = lambda url: None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve with `count` API server processes until SIGINT/SIGTERM (or cancellation)."""
    args = EngineArgs(model=model, **engine_args)
    listener = bind_shared(host, port)
    bound = listener.getsockname()
    url = f"http://{f'[{bound[0]}]' if ':' in bound[0] else bound[0]}:{bound[1]}"
    metrics_dir = tempfile.mkdtemp(prefix="triode-metrics-")
    fields, digests = settings_to_builtins(settings)
    try:
        async with open_engine_cores(args, num_clients=count) as cores:
            log.info("%d engine core(s) ready; starting %d API servers", len(cores), count)
            servers = _ApiServers(
                count,
                lambda i: ApiServerOptions(
                    client_index=i,
                    host=bound[0],
                    port=bound[1],
                    # as they run now: a dead engine core's place is taken by another
                    endpoints=[endpoint for endpoint, _ in cores],
                    settings=fields,
                    api_key_digests=digests,
                    root_path=root_path,
                    graceful_timeout=graceful_timeout,
                ),
                metrics_dir,
            )
            async with trio.open_nursery() as nursery:
                for i in range(count):
                    nursery.start_soon(servers.supervise, i)
                await servers.all_ready.wait()
                announce(url)
                task_status.started([url])
                await _until_signalled(servers, nursery.cancel_scope, graceful_timeout)
            log.info("API servers stopped; stopping the engine cores")
    finally:
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _ApiServers:
    """The API server processes, each kept running by its own `supervise` task."""

    def __init__(
        self,
        count: int,
        options: Callable[[int], ApiServerOptions],
        metrics_dir: str,
        target: str = API_SERVER,
    ) -> None:
        self.count = count
        self._options = options
        self._metrics_dir = metrics_dir
        self._target = target
        self._children: list[Child | None] = [None] * count
        self.restarts = 0
        self.draining = False
        self.all_ready = trio.Event()
        self.all_exited = trio.Event()
        self._running = 0

    @property
    def pids(self) -> list[int | None]:
        """Each API server's latest process id (None before its first start)."""
        return [None if child is None else child.pid for child in self._children]

    async def supervise(self, index: int) -> None:
        deaths = RestartBudget(MAX_RESTARTS - 1, RESTART_WINDOW)
        env = {MULTIPROC_DIR_ENV: self._metrics_dir}
        while True:
            async with open_child(
                self._target,
                name=f"api-server-{index}",
                options=msgspec.to_builtins(self._options(index)),
                raise_on_death=False,
                env=env,
                ready_timeout=120.0,
            ) as child:
                self._children[index] = child
                if self.draining:  # started again just as the drain began
                    child.expect_exit()
                    os.kill(child.pid, signal.SIGTERM)
                self._running += 1
                if all(self._children):
                    self.all_ready.set()
                try:
                    await child.exited.wait()
                finally:
                    self._running -= 1
                    if not self._running and self.draining:
                        self.all_exited.set()
            multiprocess.mark_process_dead(child.pid, self._metrics_dir)
            if self.draining:
                return
            if not deaths.allow():
                raise RuntimeError(
                    f"API server {index} died {MAX_RESTARTS} times within "
                    f"{RESTART_WINDOW:.0f}s ({child.error}); stopping the server"
                )
            self.restarts += 1
            log.error("API server %d died (%s); starting another", index, child.error)

    def drain(self) -> None:
        """SIGTERM to every API server: each finishes its requests, then exits."""
        self.draining = True
        for child in self._children:
            if child is not None and child.alive:
                child.expect_exit()
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


async def _until_signalled(
    servers: _ApiServers, scope: trio.CancelScope, graceful_timeout: float
) -> None:
    """The first SIGINT/SIGTERM drains every API server (they get SIGTERM); a second one, or
    the drain outlasting the graceful timeout, stops them at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if servers.draining:
                log.warning("%s again: stopping without waiting for requests", name)
                if signum == signal.SIGINT:  # an interrupt: the command exits 130
                    raise KeyboardInterrupt
                break
            log.info("%s: API servers finish their in-flight requests, then shut down", name)
            servers.drain()
            with trio.move_on_after(graceful_timeout + EXIT_GRACE):
                await servers.all_exited.wait()
            break
    scope.cancel()
