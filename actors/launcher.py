"""Starting the engine cores of one server: `--data-parallel-size` of them, each with its own
KV cache, model (and model workers) and input and output sockets.

`open_engine_cores` starts them side by side, returns once every one is READY, and describes
each as an `EngineCoreEndpoint`: what a client (in this process, or in an API server process
that the same parent started) needs to connect to it. With several engines on one host, each
takes an equal share of the CPUs this process may use, so that their model threads do not
fight over the same cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import trio

from triode.wire import Ready

from .config import EngineArgs
from .errors import ActorError, RemoteError, exception_leaves
from .model_env import model_process_env
from .process import Child, open_child

ENGINE_CORE = "triode.actors.core.main:serve_engine_core"


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


@asynccontextmanager
async def open_engine_cores(
    args: EngineArgs, *, num_clients: int = 1
) -> AsyncIterator[list[tuple[EngineCoreEndpoint, Child]]]:
    """Start `args.data_parallel_size` engine cores for `num_clients` clients, each in the
    model processes' environment (`model_process_env`), and yield each one's endpoint and
    child once all are READY. Raises (in an exception group) `EngineCoreStartError`, chained
    from what `open_child` raised, if any fails to start; the others are then stopped. Leaving
    the block
    stops them all. A core that dies later does not raise here: its `Child` says so, and its
    clients fail its requests."""
    count = args.data_parallel_size
    tmpdir = tempfile.mkdtemp(prefix="triode-engine-")
    started: list[tuple[EngineCoreEndpoint, Child] | None] = [None] * count
    all_ready = trio.Event()
    stop = trio.Event()

    async def run_core(index: int, cpus: list[int] | None) -> None:
        addresses = {
            "input": f"ipc://{tmpdir}/input-{index}",
            "output": f"ipc://{tmpdir}/output-{index}",
        }
        options = {
            "engine_args": msgspec.to_builtins(engine_args_of(args, index)),
            "num_clients": num_clients,
            "engine_index": index,
            "cpus": cpus,
        }
        try:
            async with open_child(
                ENGINE_CORE,
                name="engine-core" if count == 1 else f"engine-core-{index}",
                addresses=addresses,
                options=options,
                raise_on_death=False,
                env=model_process_env(os.environ),
                ready_timeout=ready_timeout(),
            ) as child:
                assert child.ready is not None
                endpoint = EngineCoreEndpoint(
                    index=index,
                    pid=child.pid,
                    input=addresses["input"],
                    output=addresses["output"],
                    ready=child.ready,
                )
                started[index] = (endpoint, child)
                if all(started):
                    all_ready.set()
                await stop.wait()
        except* (ActorError, trio.TooSlowError) as group:
            if started[index] is not None:
                raise
            raise EngineCoreStartError(start_failure_line(group)) from group

    try:
        async with trio.open_nursery() as nursery:
            for index, cpus in enumerate(cpu_shares(count)):
                nursery.start_soon(run_core, index, cpus)
            await all_ready.wait()
            try:
                yield [s for s in started if s is not None]
            finally:
                stop.set()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
