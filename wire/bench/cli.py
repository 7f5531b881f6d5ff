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
import json
import os
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import trio
import zmq

from ..codec import Buffer, Encoder
from ..framing import encode_input
from ..messages import EngineCoreRequestType
from .cases import bench_codec, make_outputs, make_request
from .peer import run_peer
from .report import CODEC, TRANSPORT, Result, format_table
from .transport import TransportRun, bench_transport, transport_results


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
