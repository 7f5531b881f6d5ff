"""The transport case: a client through the trio adapter and one through blocking pyzmq, each
against an echo peer process of its own kind (`peer`), for throughput (pipelined) and round-trip
latency (one message at a time).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio
import zmq

from ..codec import Buffer
from ..zsocket import Socket
from .peer import echo_peer, raw_socket
from .report import TRANSPORT, Result, percentile

THROUGHPUT_TARGET = 0.7  # trio adapter msg/s / raw pyzmq msg/s
TIMEOUT = 30.0  # seconds a client waits for one echo, the peer's start included
WARMUP_ROUND_TRIPS = 200


@dataclass(frozen=True)
class TransportRun:
    """One client's throughput in messages/s and its round-trip times in ns."""

    msgs_per_s: float
    round_trips_ns: list[int]


def bench_transport(
    kind: str, frames: list[Buffer], *, messages: int, round_trips: int, window: int
) -> TransportRun:
    """One throughput run and `round_trips` ping-pongs of `kind` ("trio" or "raw") against an
    echo peer of the same kind, after a warm-up that proves both connections are up."""
    client = _trio_client if kind == "trio" else _raw_client
    with echo_peer(kind) as (in_addr, out_addr):
        return client(in_addr, out_addr, frames, messages, round_trips, window)


def _trio_client(
    in_addr: str, out_addr: str, frames: list[Buffer], messages: int, round_trips: int, window: int
) -> TransportRun:
    async def main() -> TransportRun:
        with zmq.Context() as ctx:
            async with (
                Socket.open(ctx, zmq.PUSH, connect=in_addr) as push,
                Socket.open(ctx, zmq.PULL, connect=out_addr) as pull,
            ):
                with trio.fail_after(TIMEOUT):
                    await _trio_ping_pong(push, pull, frames, 1)
                # Generous: fails only below ~1,000 msg/s; a per-message deadline would cost.
                with trio.fail_after(
                    TIMEOUT + 1e-3 * (WARMUP_ROUND_TRIPS + messages + round_trips)
                ):
                    await _trio_ping_pong(push, pull, frames, WARMUP_ROUND_TRIPS)
                    rate = await _trio_throughput(push, pull, frames, messages, window)
                    samples = await _trio_ping_pong(push, pull, frames, round_trips)
        return TransportRun(rate, samples)

    return trio.run(main)


async def _trio_ping_pong(push: Socket, pull: Socket, frames: list[Buffer], n: int) -> list[int]:
    """Round-trip times in ns of `n` messages sent one at a time."""
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        await push.send_multipart(frames)
        await pull.recv_multipart()
        samples.append(time.perf_counter_ns() - start)
    return samples


async def _trio_throughput(
    push: Socket, pull: Socket, frames: list[Buffer], n: int, window: int
) -> float:
    """Messages per second echoed with a send task and a receive task, `window` in flight.

    A free slot is taken without a checkpoint, as a thread takes an uncontended semaphore: the
    send that follows is the checkpoint.
    """
    slots = trio.Semaphore(window)

    async def send() -> None:
        for _ in range(n):
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                await slots.acquire()
            await push.send_multipart(frames)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        for _ in range(n):
            await pull.recv_multipart()
            slots.release()
    return n / (time.perf_counter() - start)


def _raw_client(
    in_addr: str, out_addr: str, frames: list[Buffer], messages: int, round_trips: int, window: int
) -> TransportRun:
    with (
        zmq.Context() as ctx,
        raw_socket(ctx, zmq.PUSH, connect=in_addr) as push,
        raw_socket(ctx, zmq.PULL, connect=out_addr, timeout=TIMEOUT) as pull,
    ):
        _raw_ping_pong(push, pull, frames, 1 + WARMUP_ROUND_TRIPS)
        rate = _raw_throughput(push, pull, frames, messages, window)
        samples = _raw_ping_pong(push, pull, frames, round_trips)
    return TransportRun(rate, samples)


def _raw_ping_pong(push: zmq.Socket, pull: zmq.Socket, frames: list[Buffer], n: int) -> list[int]:
    """Round-trip times in ns of `n` messages sent one at a time."""
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        push.send_multipart(frames, copy=False)
        pull.recv_multipart(copy=False)
        samples.append(time.perf_counter_ns() - start)
    return samples


def _raw_throughput(
    push: zmq.Socket, pull: zmq.Socket, frames: list[Buffer], n: int, window: int
) -> float:
    """Messages per second echoed with a sending thread and this thread receiving."""
    slots = threading.Semaphore(window)
    stop = threading.Event()

    def send() -> None:
        for _ in range(n):
            while not slots.acquire(timeout=0.1):
                if stop.is_set():
                    return
            push.send_multipart(frames, copy=False)

    sender = threading.Thread(target=send, name="bench-send")
    start = time.perf_counter()
    sender.start()
    try:
        for _ in range(n):
            pull.recv_multipart(copy=False)
            slots.release()
        return n / (time.perf_counter() - start)
    finally:
        stop.set()
        sender.join()


def transport_results(
    trio_runs: Sequence[TransportRun], raw_runs: Sequence[TransportRun]
) -> list[Result]:
    """Rows for the median throughput and the p50/p99 of all round trips, trio adapter first."""
    trio_rate = statistics.median(r.msgs_per_s for r in trio_runs)
    raw_rate = statistics.median(r.msgs_per_s for r in raw_runs)
    rows = [
        Result(
            TRANSPORT,
            "throughput, msg/s",
            trio_rate,
            raw_rate,
            trio_rate / raw_rate,
            THROUGHPUT_TARGET,
        )
    ]
    trio_rtts = [ns for r in trio_runs for ns in r.round_trips_ns]
    raw_rtts = [ns for r in raw_runs for ns in r.round_trips_ns]
    for q in (50, 99):
        a, b = percentile(trio_rtts, q) / 1e3, percentile(raw_rtts, q) / 1e3
        rows.append(Result(TRANSPORT, f"round trip p{q}, µs", a, b, a / b))
    return rows
