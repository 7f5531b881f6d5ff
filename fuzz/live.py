"""The live fuzzer: hostile traffic against a running server (HTTP) and engine core (ZMQ).

```sh
python -m triode.fuzz.live http|zmq|all --seconds N --seed S \\
    [--url URL --api-key K | --launch [MODEL]]
python -m triode.fuzz.live replay PATH [--url URL --api-key K | --launch [MODEL]]
```

(`triode fuzz ...` is the same command.) Each mode sends mutated traffic in rounds and checks
its invariants between rounds; the first violation stops the run, writes what was sent under
`fuzz/crashes/` and prints how to replay it. The exit status is 1 after a violation.

This module holds what both modes share: the report, the violation, crash files, the memory
watch over the processes under test, and the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

CRASH_DIR = Path(__file__).resolve().parent / "crashes"
DEFAULT_API_KEY = "fuzz-key"
# For the processes the fuzzer launches. torch's oneDNN compiles and keeps one primitive per
# matrix shape, in two LRU caches of 1,024 entries: an engine whose steps keep taking new sizes,
# as they do under fuzzing, grows by hundreds of MiB before those fill. Small caches keep the
# memory invariant about triode's own memory. The engine core's log would repeat every bad
# message the fuzzer counts already.
LAUNCH_ENV = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    "LRU_CACHE_CAPACITY": "64",
    "TRIODE_LOG_LEVEL": "ERROR",
}
# Resident memory may grow this much over its post-warm-up value before it counts as a leak.
RSS_GROWTH_FACTOR = 1.5
RSS_GROWTH_SLACK = 200 << 20


class Violation(Exception):
    """An invariant broke. `reproducer` is the file (or folder) holding what triggered it."""

    def __init__(self, message: str, reproducer: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reproducer = reproducer


@dataclass
class Report:
    """What one mode sent and saw."""

    mode: str
    seed: int
    sent: Counter[str] = field(default_factory=Counter)  # by kind of mutation
    outcomes: Counter[str] = field(default_factory=Counter)  # HTTP status, or ZMQ outcome
    protocol_errors: int = 0  # undecodable frames the engine counted (ZMQ)
    rounds: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    replay: str = ""  # the command that replays the first violation
    engine: dict[str, Any] = field(default_factory=dict)  # its last stats (ZMQ)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def rate(self) -> float:
        return self.total / self.seconds if self.seconds else math.nan

    def format(self) -> str:
        unit = "requests" if self.mode == "http" else "messages"
        lines = [
            f"live fuzz {self.mode} (seed {self.seed}): {self.total} {unit} in {self.rounds} "
            f"rounds, {self.seconds:.1f} s, {self.rate:.0f}/s",
            "  sent by kind: " + _counts(self.sent),
            ("  status codes: " if self.mode == "http" else "  outcomes: ")
            + _counts(self.outcomes),
        ]
        if self.mode == "zmq":
            lines.append(f"  protocol errors counted by the engine: {self.protocol_errors}")
            lines.append("  engine: " + ", ".join(f"{k} {v}" for k, v in self.engine.items()))
        lines.append(f"  violations: {len(self.violations)}")
        lines += [f"    {v}" for v in self.violations]
        if self.replay:
            lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1]))


def crash_path(name: str, directory: Path | None = None) -> Path:
    """A fresh path for a reproducer named `name` under `directory` (default `fuzz/crashes/`)."""
    directory = directory or CRASH_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = directory / f"{name}-{stamp}"
    n = 0
    while path.exists():
        n += 1
        path = directory / f"{name}-{stamp}-{n}"
    return path


# Processes under test


def rss_bytes(pid: int) -> int | None:
    """The resident set size of `pid` (VmRSS), or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (exists and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    """The children of `pid`, started by any of its threads."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    pids = []
    for task in tasks:
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


class MemoryWatch:
    """Resident memory of named processes against their post-warm-up values."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.baseline: dict[str, int] = {}

    def settle(self) -> None:
        """Take the current sizes as the baseline (call once warmed up)."""
        self.baseline = {n: r for n, p in self.pids.items() if (r := rss_bytes(p)) is not None}

    def check(self) -> str | None:
        """A description of the first process past its bound, or None."""
        for name, base in self.baseline.items():
            now = rss_bytes(self.pids[name])
            bound = RSS_GROWTH_FACTOR * base + RSS_GROWTH_SLACK
            if now is not None and now > bound:
                return (
                    f"{name} (pid {self.pids[name]}) grew from {base >> 20} MiB to "
                    f"{now >> 20} MiB after warm-up (bound {int(bound) >> 20} MiB)"
                )
        return None

    def describe(self) -> str:
        sizes = {n: rss_bytes(p) for n, p in self.pids.items()}
        return ", ".join(
            f"{n} {self.baseline.get(n, 0) >> 20}->{(s or 0) >> 20} MiB" for n, s in sizes.items()
        )


# The command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode fuzz",
        description="Fuzz a live server over HTTP and an engine core over ZMQ, checking "
        "invariants between rounds; exit status 1 on the first violation.",
    )
    parser.add_argument("mode", choices=["http", "zmq", "all", "replay"])
    parser.add_argument("path", nargs="?", type=Path, help="replay: a crash file or folder")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long each mode runs (default 60)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="http: fuzz the server at this URL instead of launching one")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"the server's API key (with --url); a launched server gets {DEFAULT_API_KEY!r}",
    )
    parser.add_argument(
        "--launch",
        nargs="?",
        const="default",
        default=None,
        metavar="MODEL",
        help="launch the server or engine on MODEL (no MODEL: the default model; without "
        "--launch: http launches the default model, zmq tiny-random)",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="http: connections at once")
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="for the launched engine (default: the engine's; zmq on tiny-random: "
        "1MiB, so that requests contend for blocks)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="for the launched engine")
    parser.add_argument(
        "--crash-dir", type=Path, default=None, help=f"where reproducers go (default {CRASH_DIR})"
    )
    args = parser.parse_args(argv)
    if args.mode == "replay" and (args.path is None or not args.path.exists()):
        parser.error("replay needs the PATH of a crash file or folder")
    if args.url and args.launch:
        parser.error("give --url or --launch, not both")
    return args


def launch_model(args: argparse.Namespace, default: str | None) -> str | None:
    """The model to launch: --launch's (bare: the default model), else `default`."""
    if args.launch is None:
        return default
    return None if args.launch == "default" else args.launch


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line."""
    flags = ("kv_cache_memory", "max_num_seqs")
    return {k: v for k in flags if (v := getattr(args, k)) is not None}


def main(argv: list[str] | None = None) -> int:
    import trio

    from . import live_http, live_zmq

    args = parse_args(argv)
    model = launch_model(args, "tiny-random")
    zmq_engine_args = engine_flags(args)
    if model == "tiny-random":
        zmq_engine_args.setdefault("kv_cache_memory", live_zmq.SMALL_KV_CACHE)
    for name, value in LAUNCH_ENV.items():
        if name != "TRIODE_LOG_LEVEL" or args.mode != "replay":  # a replay shows the log
            os.environ.setdefault(name, value)
    if args.mode == "replay":
        if args.path.suffix == ".zmq":
            return trio.run(partial(live_zmq.replay, args.path, model, **zmq_engine_args))
        return trio.run(live_http.replay, args.path, args)
    reports = []
    for mode in ("http", "zmq") if args.mode == "all" else (args.mode,):
        if mode == "http":
            report = trio.run(live_http.fuzz, args)
        else:
            fuzz_zmq = partial(live_zmq.fuzz_engine, model, args.seconds, args.seed)
            report = trio.run(partial(fuzz_zmq, args.crash_dir, **zmq_engine_args))
        print(report.format(), flush=True)
        reports.append(report)
        if report.violations:
            break
    return 1 if any(r.violations for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
