"""Starting the engine cores of one server: `--data-parallel-size` of them, each with its own
KV cache, model (and model workers) and input and output sockets.

`open_engine_cores` starts them side by side, returns once every one is READY, and describes
each as an `EngineCoreEndpoint`: what a client (in this process, or in an API server process
that the same parent started) needs to connect to it. With several engines on one host, each
takes an equal share of the CPUs this process may use, so that their model threads do not
fight over the same cores.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import trio

from triode.wire import Ready

from .config import EngineArgs
from .errors import ActorError, RemoteError, exception_leaves
from .model_env import model_process_env
from .process import Child, RestartBudget, open_child

ENGINE_CORE = "triode.actors.core.main:serve_engine_core"

log = logging.getLogger("triode.serve")


def ready_timeout() -> float:
    """How long a process that loads the model may take to say READY (TRIODE_ENGINE_READY_TIMEOUT
    seconds, 900 by default: a first start converts the GGUF file)."""
    return float(os.environ.get("TRIODE_ENGINE_READY_TIMEOUT", 900))


class EngineCoreStartError(Exception):
    """An engine core that failed before it said READY; `line` says why in one line (its
    exception's type and message, or how it died), and the exception it chains from holds the
    whole story (the remote traceback)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line

    @staticmethod
    def summary(group: BaseExceptionGroup) -> str:
        """The distinct lines of the start errors in `group` (several engine cores may fail)."""
        lines = (e.line for e in exception_leaves(group) if isinstance(e, EngineCoreStartError))
        return "; ".join(dict.fromkeys(lines))


def start_failure_line(group: BaseExceptionGroup) -> str:
    """One line for what an engine core's start raised: each distinct failure's first line."""
    lines: list[str] = []
    for leaf in exception_leaves(group):
        if isinstance(leaf, RemoteError):
            message = (leaf.remote_message.strip().splitlines() or [""])[0]
            line = f"{leaf.type_name}: {message}"
        elif isinstance(leaf, trio.TooSlowError):
            line = f"not READY within {ready_timeout():g} s (TRIODE_ENGINE_READY_TIMEOUT)"
        else:
            line = (str(leaf).strip().splitlines() or [type(leaf).__name__])[0]
        lines.append(line)
    return "; ".join(dict.fromkeys(lines))


class EngineCoreEndpoint(msgspec.Struct, kw_only=True):
    """One running engine core: its index, process, sockets and READY."""

    index: int
    pid: int
    input: str  # the ZMQ address of its PULL socket
    output: str  # the ZMQ address of its XPUB socket
    ready: Ready


def cpu_shares(count: int) -> list[list[int] | None]:
    """Each of `count` engines' CPUs: equal, contiguous shares of this process's, or None (all
    of them) for a single engine or when there are fewer CPUs than engines."""
    cpus = sorted(os.sched_getaffinity(0))
    per_engine = len(cpus) // count
    if count == 1 or per_engine == 0:
        return [None] * count
    return [cpus[i * per_engine : (i + 1) * per_engine] for i in range(count)]


def engine_args_of(args: EngineArgs, index: int) -> EngineArgs:
    """Engine `index`'s arguments: a rendezvous port of its own for its model workers."""
    if args.master_port is None or index == 0:
        return args
    return msgspec.structs.replace(args, master_port=args.master_port + index)


class EngineCoreFailed(Exception):
    """An engine core died more often than `--max-engine-restarts` allows within
    `--engine-restart-window` (a crash loop, or 0 restarts allowed): the server ends. `line`
    says so in one line, with the last death's cause."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def death_cause(child: Child) -> str:
    """How an engine core ended, in one line: the signal that killed it, or its exit status
    and the last line of the error it reported."""
    code = child.returncode
    how = f"exit status {code}"
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    if isinstance(child.error, RemoteError):
        lines = child.error.remote_message.strip().splitlines() or [""]
        how += f": {child.error.type_name}: {lines[-1]}"
    return how


@asynccontextmanager
async def open_engine_cores(
    args: EngineArgs, *, num_clients: int = 1
) -> AsyncIterator[list[tuple[EngineCoreEndpoint, Child]]]:
    """Start `args.data_parallel_size` engine cores for `num_clients` clients, each in the
    model processes' environment (`model_process_env`), and yield each one's endpoint and
    child once all are READY. Raises (in an exception group) `EngineCoreStartError`, chained
    from what `open_child` raised, if any fails to start; the others are then stopped. Leaving
    the block stops them all.

    An engine core that dies later is started again in its place, at the same addresses, with
    the same arguments, the adapters and weights it served (`core/standing.py`), and its
    `incarnation` counted in its READY; the yielded list then holds the new one. Its clients
    fail its requests and reconnect by themselves (`EngineCoreClient`). One log line says why
    each died. Past `args.max_engine_restarts` deaths within `args.engine_restart_window`
    seconds this raises `EngineCoreFailed` (in an exception group)."""
    count = args.data_parallel_size
    tmpdir = tempfile.mkdtemp(prefix="triode-engine-")
    started: list[tuple[EngineCoreEndpoint, Child] | None] = [None] * count
    live: list[tuple[EngineCoreEndpoint, Child]] = []
    all_ready = trio.Event()
    stop = trio.Event()
    starting: list[trio.CancelScope | None] = [None] * count

    async def run_core(index: int, cpus: list[int] | None) -> None:
        addresses = {
            "input": f"ipc://{tmpdir}/input-{index}",
            "output": f"ipc://{tmpdir}/output-{index}",
        }
        name = "engine-core" if count == 1 else f"engine-core-{index}"
        restarts = RestartBudget(args.max_engine_restarts, args.engine_restart_window)
        incarnation = 0
        while True:
            options = {
                "engine_args": msgspec.to_builtins(engine_args_of(args, index)),
                "num_clients": num_clients,
                "engine_index": index,
                "cpus": cpus,
                "standing_file": f"{tmpdir}/standing-{index}.json",
                "incarnation": incarnation,
            }
            begun = time.perf_counter()
            cause = ""
            # cancelled when the engine cores stop while this one starts again
            with trio.CancelScope() as starting[index]:
                try:
                    async with open_child(
                        ENGINE_CORE,
                        name=name,
                        addresses=addresses,
                        options=options,
                        raise_on_death=False,
                        env=model_process_env(os.environ),
                        ready_timeout=ready_timeout(),
                    ) as child:
                        starting[index] = None
                        assert child.ready is not None
                        endpoint = EngineCoreEndpoint(
                            index=index,
                            pid=child.pid,
                            input=addresses["input"],
                            output=addresses["output"],
                            ready=child.ready,
                        )
                        if started[index] is None:
                            started[index] = (endpoint, child)
                            if all(started):
                                live.extend(s for s in started if s is not None)
                                all_ready.set()
                        else:
                            live[index] = (endpoint, child)
                            log.warning(
                                "%s started again in %.1f s (pid %d, restart %d)",
                                name,
                                time.perf_counter() - begun,
                                child.pid,
                                incarnation,
                            )
                        await _either(stop, child.exited)
                        if stop.is_set():
                            return
                        cause = death_cause(child)
                except* (ActorError, trio.TooSlowError) as group:
                    if started[index] is None:
                        raise EngineCoreStartError(start_failure_line(group)) from group
                    cause = f"did not start again: {start_failure_line(group)}"
            if stop.is_set():
                return
            if not restarts.allow():
                raise EngineCoreFailed(
                    f"{name} died {restarts.count} time(s) within "
                    f"{restarts.window:g} s, more than --max-engine-restarts "
                    f"{restarts.limit} allows; last: {cause}"
                )
            incarnation += 1
            log.error("%s died (%s); starting it again (restart %d)", name, cause, incarnation)

    try:
        async with trio.open_nursery() as nursery:
            for index, cpus in enumerate(cpu_shares(count)):
                nursery.start_soon(run_core, index, cpus)
            await all_ready.wait()
            try:
                yield live
            finally:
                stop.set()
                for scope in starting:
                    if scope is not None:
                        scope.cancel()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


async def _either(*events: trio.Event) -> None:
    """Return once any of `events` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            nursery.start_soon(_cancel_when_set, event, nursery.cancel_scope)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
