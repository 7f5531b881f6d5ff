"""Actors that the runtime tests start in child processes (imported there via PYTHONPATH)."""

from __future__ import annotations

import signal

import msgspec
import numpy as np
import trio
import zmq

from triode.actors import ChildContext, ZmqReceiveChannel, ZmqSendChannel
from triode.wire import Decoder, Encoder, Ready, Socket


class Probe(msgspec.Struct, array_like=True, gc=False):
    seq: int
    payload: np.ndarray


def probe_edges(ctx: zmq.Context, inbox: str, outbox: str, *, bind: bool):
    """The two edges of an echo exchange; the parent binds, the child connects."""
    where = "bind" if bind else "connect"
    encoder = Encoder()
    recv = ZmqReceiveChannel(Socket.open(ctx, zmq.PULL, **{where: inbox}), Decoder(Probe).decode)
    send = ZmqSendChannel(Socket.open(ctx, zmq.PUSH, **{where: outbox}), encoder.encode)
    return send, recv


async def echo(ctx: ChildContext) -> None:
    """Replies to each Probe with the same seq and the payload doubled."""
    send, recv = probe_edges(
        ctx.zmq_context, ctx.addresses["to_child"], ctx.addresses["to_parent"], bind=False
    )
    async with send, recv:
        await ctx.ready(Ready(num_kv_blocks=7, block_size=16, max_model_len=2048))
        async for probe in recv:
            await send.send(Probe(probe.seq, probe.payload * 2))


async def crash_after_ready(ctx: ChildContext) -> None:
    await ctx.ready()
    await trio.sleep(ctx.options.get("delay", 0.2))
    raise ValueError("the probe asked this actor to fail")


async def crash_before_ready(ctx: ChildContext) -> None:
    raise RuntimeError("cannot start: no model here")


async def sleep_forever(ctx: ChildContext) -> None:
    await ctx.ready()
    await trio.sleep_forever()


async def ignore_shutdown(ctx: ChildContext) -> None:
    """Keeps running after SHUTDOWN; SIGTERM still ends it."""
    await ctx.ready()
    with trio.CancelScope(shield=True):
        await trio.sleep_forever()


async def ignore_sigterm(ctx: ChildContext) -> None:
    """Only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    await ctx.ready()
    with trio.CancelScope(shield=True):
        await trio.sleep_forever()


async def never_ready(ctx: ChildContext) -> None:
    await trio.sleep_forever()


async def report_facts(ctx: ChildContext) -> None:
    """Writes what this process is to `ctx.options["path"]` (JSON), then serves until stopped."""
    import json
    import os
    import random
    from pathlib import Path

    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # noqa: ASYNC240
    facts = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "session": int(stat[3]),
        "cwd": os.getcwd(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "mark": os.environ.get("TRIODE_TEST_MARK"),
        "random": random.random(),
        "numpy_random": float(np.random.random()),
        "comm": Path("/proc/self/comm").read_text().strip(),  # noqa: ASYNC240
    }
    Path(ctx.options["path"]).write_text(json.dumps(facts))  # noqa: ASYNC240
    await ctx.ready()
    await trio.sleep_forever()
