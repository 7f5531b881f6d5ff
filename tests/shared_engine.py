"""Engine cores started once for a module's tests, which connect to them one after another.

pytest-trio runs each test in a trio run of its own, so an `Engine` cannot outlive a test; the
engine core processes can. `engine_cores` starts them from a trio run on a thread of its own and
yields their endpoints; each test connects with `connect_engine` (a client, as an API server is),
and `fresh_engine` hands a test the engine as a new one would be: nothing running or waiting,
awake, every KV block free and the prefix cache empty.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio
from processes import alive

from triode.actors import Engine, EngineArgs, connect_engine
from triode.actors.launcher import EngineCoreEndpoint, open_engine_cores

START_TIMEOUT = 240.0


@contextmanager
def engine_cores(model: str, **engine_args: Any) -> Iterator[list[EngineCoreEndpoint]]:
    """Start the engine cores `open_engine(model, **engine_args)` would, yield their endpoints,
    and stop them on exit; no core process outlives the block."""
    started: queue.Queue[list[EngineCoreEndpoint] | BaseException] = queue.Queue()
    stop = threading.Event()

    async def run() -> None:
        try:
            async with open_engine_cores(EngineArgs(model=model, **engine_args)) as cores:
                started.put([endpoint for endpoint, _ in cores])
                await trio.to_thread.run_sync(stop.wait)
        except BaseException as e:
            started.put(e)
            raise

    failure: list[BaseException] = []

    def thread_main() -> None:
        try:
            trio.run(run)
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=thread_main, name="engine-cores", daemon=True)
    thread.start()
    got = started.get(timeout=START_TIMEOUT)
    if isinstance(got, BaseException):
        thread.join()
        raise RuntimeError("the shared engine cores did not start") from got
    try:
        yield got
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive() and not failure, failure
        assert not any(alive(endpoint.pid) for endpoint in got)


@asynccontextmanager
async def fresh_engine(endpoints: list[EngineCoreEndpoint]) -> AsyncIterator[Engine]:
    """An `Engine` over the shared `endpoints`, as a newly started one would be: the prefix
    cache emptied, and checked to be awake with nothing running and every KV block free."""
    async with connect_engine(endpoints) as engine:
        assert await engine.admin.is_sleeping() is False
        stats = await idle_stats(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert await engine.admin.reset_prefix_cache() is True
        yield engine


async def stats_when(engine: Engine, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The engine's stats once `condition` holds of them (polled, within 10 s)."""
    with trio.fail_after(10):
        while True:
            stats = await engine.get_stats()
            if condition(stats):
                return stats
            await trio.sleep(0.01)


async def idle_stats(engine: Engine) -> dict[str, Any]:
    """The engine's stats once it runs and queues nothing (within 10 s)."""
    return await stats_when(
        engine, lambda stats: stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    )
