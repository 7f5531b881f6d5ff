"""Wire benchmark: the msgspec codec against pickle, and the trio ZMQ adapter against raw pyzmq.

Run `python -m triode.wire.bench [--messages N] [--round-trips N] [--json PATH]`. It prints one
table and, for each target, whether this run met it; it never fails on a missed target.

- Codec: encode + decode time of one message, a median over repeats of a timed loop, for
  `triode.wire.Encoder`/`Decoder` (one of each, reused) against `pickle.dumps`/`loads`.
- Transport: an echo peer in a second process over `ipc://` PUSH/PULL pairs. Throughput is
  pipelined (the client sends while it receives, at most `window` messages in flight); latency is
  one message at a time. The trio side uses `triode.wire.Socket` in client and peer; the raw side
  uses blocking pyzmq, the client with one thread per socket. Both send and receive with
  `copy=False`, the adapter's default.

`--peer trio|raw --in ADDR --out ADDR` runs the echo peer itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import trio
import zmq

from .codec import Buffer, Decoder, Encoder
from .framing import encode_input
from .messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SamplingParams,
    SchedulerStats,
)
from .zsocket import Socket

CODEC_TARGET = 3.0  # pickle time / msgspec time
THROUGHPUT_TARGET = 0.7  # trio adapter msg/s / raw pyzmq msg/s
TIMEOUT = 30.0  # seconds a client waits for one echo, the peer's start included
WARMUP_ROUND_TRIPS = 200

CODEC = "codec"
TRANSPORT = "transport"
_HEADERS = {
    CODEC: ("Codec: encode+decode per message", "msgspec µs", "pickle µs", "pickle/msgspec"),
    TRANSPORT: (
        "Transport over ipc:// (echo peer process)",
        "trio adapter",
        "raw pyzmq",
        "trio/raw",
    ),
}


@dataclass(frozen=True)
class Result:
    """One table row: the same measurement for the two contenders and their ratio.

    `first` is msgspec or the trio adapter, `second` pickle or raw pyzmq. `ratio` is oriented so
    that bigger favours `first` for the codec and throughput; for latency it is trio/raw as is.
    """

    section: str
    name: str
    first: float
    second: float
    ratio: float
    target: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


# Messages


def make_request(prompt_len: int, rng: random.Random) -> EngineCoreRequest:
    """A tokenized request with `prompt_len` random token ids below 50,000."""
    return EngineCoreRequest(
        request_id="req-123",
        prompt_token_ids=[rng.randrange(50_000) for _ in range(prompt_len)],
        sampling_params=SamplingParams(
            temperature=0.7, top_p=0.95, max_tokens=256, seed=1234, stop=["</s>"]
        ),
        eos_token_id=2,
        arrival_time=1_700_000_000.0,
    )


def make_outputs(batch: int, rng: random.Random) -> EngineCoreOutputs:
    """One decode step's outputs for `batch` requests, one new token each."""
    return EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id=f"req-{i}", new_token_ids=[rng.randrange(50_000)])
            for i in range(batch)
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=batch, kv_cache_usage=0.5),
        seq=42,
        timestamp=1_700_000_000.0,
    )


# Codec


def time_per_call(fn: Callable[[], object], *, repeats: int, min_time: float) -> float:
    """Median over `repeats` timed loops of `fn`'s time per call, in microseconds.

    The loop count doubles until one loop takes `min_time` seconds. GC stays enabled, as in a
    server.
    """
    loops = 1
    while _timed_loop(fn, loops) < min_time:
        loops *= 2
    return statistics.median(_timed_loop(fn, loops) / loops * 1e6 for _ in range(repeats))


def _timed_loop(fn: Callable[[], object], loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return time.perf_counter() - start


def bench_codec(msg: Any, name: str, *, repeats: int = 7, min_time: float = 0.05) -> Result:
    """Encode+decode of `msg` with one reused Encoder/Decoder against pickle's highest protocol."""
    encoder, decoder = Encoder(), Decoder(type(msg))

    def wire_round_trip() -> object:
        return decoder.decode(encoder.encode(msg))

    def pickle_round_trip() -> object:
        return pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    if wire_round_trip() != msg or pickle_round_trip() != msg:
        raise RuntimeError(f"{name} does not survive an encode/decode round trip")
    wire_us = time_per_call(wire_round_trip, repeats=repeats, min_time=min_time)
    pickle_us = time_per_call(pickle_round_trip, repeats=repeats, min_time=min_time)
    return Result(CODEC, name, wire_us, pickle_us, pickle_us / wire_us, CODEC_TARGET)


# Transport: the echo peer


def run_peer(kind: str, in_addr: str, out_addr: str) -> None:
    """Bind PULL on `in_addr` and PUSH on `out_addr`; echo frames unchanged until killed."""
    if kind == "trio":
        trio.run(_echo_trio, in_addr, out_addr)
    else:
        _echo_raw(in_addr, out_addr)


async def _echo_trio(in_addr: str, out_addr: str) -> None:
    with zmq.Context() as ctx:
        async with (
            Socket.open(ctx, zmq.PULL, bind=in_addr) as pull,
            Socket.open(ctx, zmq.PUSH, bind=out_addr) as push,
        ):
            while True:
                await push.send_multipart(await pull.recv_multipart())


def _echo_raw(in_addr: str, out_addr: str) -> None:
    with (
        zmq.Context() as ctx,
        _raw_socket(ctx, zmq.PULL, bind=in_addr) as pull,
        _raw_socket(ctx, zmq.PUSH, bind=out_addr) as push,
    ):
        while True:
            push.send_multipart(pull.recv_multipart(copy=False), copy=False)


@contextlib.contextmanager
def _raw_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    timeout: float | None = None,
) -> Iterator[zmq.Socket]:
    """A blocking socket configured as `Socket.open` configures its own (no HWM, no linger).

    With a `timeout` (seconds), a receive that waits longer raises `zmq.Again`.
    """
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if timeout is not None:
            sock.setsockopt(zmq.RCVTIMEO, round(timeout * 1000))
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
        yield sock
    finally:
        sock.close(linger=0)


@contextlib.contextmanager
def _echo_peer(kind: str) -> Iterator[tuple[str, str]]:
    """Start an echo peer process; yield its (in, out) addresses; always kill it afterwards."""
    tmp = tempfile.mkdtemp(prefix="triode-bench-")
    in_addr, out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    cmd = [sys.executable, "-m", "triode.wire.bench", "--peer", kind]
    try:
        with subprocess.Popen([*cmd, "--in", in_addr, "--out", out_addr]) as proc:
            try:
                yield in_addr, out_addr
            except (trio.TooSlowError, zmq.Again) as e:
                raise RuntimeError(f"{kind} echo peer stalled (exit code {proc.poll()})") from e
            finally:
                proc.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Transport: the clients


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
    with _echo_peer(kind) as (in_addr, out_addr):
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
        _raw_socket(ctx, zmq.PUSH, connect=in_addr) as push,
        _raw_socket(ctx, zmq.PULL, connect=out_addr, timeout=TIMEOUT) as pull,
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


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# The table


def format_table(results: Sequence[Result], notes: dict[str, list[str]]) -> str:
    """Aligned plain-text table, one block per section, with each target and its verdict."""
    label_width = max(len(r.name) for r in results)
    lines: list[str] = []
    for section, (title, first, second, ratio) in _HEADERS.items():
        rows = [r for r in results if r.section == section]
        if not rows:
            continue
        cells = [
            [r.name, _num(r.first), _num(r.second), f"{r.ratio:.2f}x", *_verdict(r)] for r in rows
        ]
        header = ["", first, second, ratio, "target", ""]
        widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
        widths[0] = max(widths[0], label_width)
        lines.append(title)
        lines += [f"  {note}" for note in notes.get(section, [])]
        for cell in [header, *cells]:
            left = cell[0].ljust(widths[0])
            right = "  ".join(c.rjust(w) for c, w in zip(cell[1:5], widths[1:5], strict=True))
            lines.append(f"  {left}  {right}  {cell[5]}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip()


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _verdict(r: Result) -> list[str]:
    if r.target is None:
        return ["", ""]
    return [f">= {r.target:g}x", "MET" if r.met else "NOT MET"]


# The run


@dataclass(frozen=True)
class Options:
    messages: int = 20_000
    round_trips: int = 2_000
    window: int = 256
    rounds: int = 5
    codec_repeats: int = 7
    codec_min_time: float = 0.05


def run(opts: Options) -> tuple[list[Result], dict[str, list[str]]]:
    """Every measurement, in table order, and a note per section saying what was measured."""
    rng = random.Random(0)
    results = [
        bench_codec(
            make_request(1000, rng), "EngineCoreRequest, 1000-token prompt", **_codec(opts)
        ),
        bench_codec(make_outputs(256, rng), "EngineCoreOutputs, 256 x 1 token", **_codec(opts)),
    ]
    frames = encode_input(Encoder(), EngineCoreRequestType.ADD_REQUEST, make_request(100, rng))
    runs = _transport_runs(frames, opts)
    results += transport_results(runs["trio"], runs["raw"])
    size = sum(len(f) for f in frames)
    notes = {
        CODEC: [f"median of {opts.codec_repeats} timed loops; one reused Encoder and Decoder"],
        TRANSPORT: [
            f"message: {len(frames)}-frame ADD_REQUEST, {size} B; {opts.rounds} rounds, trio and "
            "raw alternating, each with a new peer",
            f"throughput: {opts.messages:,} msgs, window {opts.window}, median of rounds",
            f"latency: {opts.round_trips:,} round trips a round, percentiles of all",
        ],
    }
    return results, notes


def _transport_runs(frames: list[Buffer], opts: Options) -> dict[str, list[TransportRun]]:
    """`opts.rounds` runs of each contender, alternating so that drift hits both alike."""
    runs: dict[str, list[TransportRun]] = {"trio": [], "raw": []}
    for _ in range(opts.rounds):
        for kind, kind_runs in runs.items():
            outcome = bench_transport(
                kind,
                frames,
                messages=opts.messages,
                round_trips=opts.round_trips,
                window=opts.window,
            )
            kind_runs.append(outcome)
    return runs


def _codec(opts: Options) -> dict[str, Any]:
    return {"repeats": opts.codec_repeats, "min_time": opts.codec_min_time}


def environment() -> str:
    return (
        f"Python {platform.python_version()}, pyzmq {zmq.__version__} (libzmq "
        f"{zmq.zmq_version()}), trio {trio.__version__}, msgspec {msgspec.__version__}, "
        f"{os.cpu_count()} CPUs"
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m triode.wire.bench", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = Options()
    add = parser.add_argument
    add("--messages", type=int, default=defaults.messages, help="per throughput run")
    add("--round-trips", type=int, default=defaults.round_trips, help="per latency run")
    add("--window", type=int, default=defaults.window, help="messages in flight")
    add("--rounds", type=int, default=defaults.rounds, help="transport runs per contender")
    add("--json", metavar="PATH", help="also write the results as JSON")
    add("--peer", choices=("trio", "raw"), help="run as the echo peer (with --in and --out)")
    add("--in", dest="in_addr", metavar="ADDR", help="peer: address to PULL from")
    add("--out", dest="out_addr", metavar="ADDR", help="peer: address to PUSH to")
    args = parser.parse_args(argv)
    if args.peer and not (args.in_addr and args.out_addr):
        parser.error("--peer needs --in and --out")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.peer:
        run_peer(args.peer, args.in_addr, args.out_addr)
        return
    opts = Options(
        messages=args.messages, round_trips=args.round_trips, window=args.window, rounds=args.rounds
    )
    start = time.perf_counter()
    results, notes = run(opts)
    elapsed = time.perf_counter() - start
    print(format_table(results, notes))
    print(f"\n{environment()}; ran in {elapsed:.1f} s")
    if args.json:
        _write_json(args.json, results, notes, opts, elapsed)


def _write_json(
    path: str, results: Sequence[Result], notes: dict[str, list[str]], opts: Options, elapsed: float
) -> None:
    doc = {
        "environment": environment(),
        "options": asdict(opts),
        "notes": notes,
        "elapsed_s": elapsed,
        "results": [{**asdict(r), "met": r.met} for r in results],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
