"""The live fuzzer: hostile traffic against a running server (HTTP) and engine core (ZMQ).

```sh
python -m triode.fuzz.live http|zmq|all --seconds N --seed S \\
    [--url URL --api-key K | --launch [MODEL]]
python -m triode.fuzz.live replay PATH [--url URL --api-key K | --launch [MODEL]]
python -m triode.fuzz.live chaos --minutes M [--seed S] [--launch MODEL]
```

(`triode fuzz ...` is the same command.) Each mode sends mutated traffic in rounds and checks
its invariants between rounds; the first violation stops the run, writes what was sent under
`fuzz/crashes/` and prints how to replay it. The exit status is 1 after a violation.

This module is the command line; `http_fuzzer` and `zmq_fuzzer` run the two modes, and `chaos`
the mixed load with kills (`triode fuzz chaos --help`).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio

from .report import CRASH_DIR

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
    # imported when run: the modes take the command line's helpers from this module
    from . import chaos, http_fuzzer, zmq_fuzzer

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chaos":  # a run of its own, with options of its own
        return chaos.main(argv[1:])
    args = parse_args(argv)
    model = launch_model(args, "tiny-random")
    zmq_engine_args = engine_flags(args)
    if model == "tiny-random":
        zmq_engine_args.setdefault("kv_cache_memory", zmq_fuzzer.SMALL_KV_CACHE)
    for name, value in LAUNCH_ENV.items():
        if name != "TRIODE_LOG_LEVEL" or args.mode != "replay":  # a replay shows the log
            os.environ.setdefault(name, value)
    if args.mode == "replay":
        if args.path.suffix == ".zmq":
            return trio.run(partial(zmq_fuzzer.replay, args.path, model, **zmq_engine_args))
        return trio.run(http_fuzzer.replay, args.path, args)
    reports = []
    for mode in ("http", "zmq") if args.mode == "all" else (args.mode,):
        if mode == "http":
            report = trio.run(http_fuzzer.fuzz, args)
        else:
            fuzz_zmq = partial(zmq_fuzzer.fuzz_engine, model, args.seconds, args.seed)
            report = trio.run(partial(fuzz_zmq, args.crash_dir, **zmq_engine_args))
        print(report.format(), flush=True)
        reports.append(report)
        if report.violations:
            break
    return 1 if any(r.violations for r in reports) else 0
