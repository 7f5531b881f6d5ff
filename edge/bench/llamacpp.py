"""`triode bench llamacpp`: triode beside llama.cpp's own server on GGUF files, one at a time.

For each `--model` file and each of `--rounds` rounds, starts llama.cpp's C++ server
`llama-server` (`--llama-server`, by default `$TRIODE_CACHE/llama.cpp-build/bin/llama-server`,
which `make llama-server` builds), streams the workload at each of `--concurrencies`, stops it,
then does the same with `triode serve` on the file; the next round starts with triode, and so
on, alternating. The servers never share the CPUs. llama-server batches continuously over a
fixed number of slots (`--parallel`): it is started anew for each stream count N with N slots,
each holding one request's context. triode takes any number of streams, so one start serves all
stream counts of a round.

The workload is `bench serve`'s: greedy completions of exactly `--output-len` tokens
(`ignore_eos`) for `--prompts-per-stream` prompts per stream. Both servers get the same request
and report the same usage, which is what is counted.

Each server is measured from outside: its start time (from starting the process to its first
`GET /health` 200; triode's first start on a file may include converting it), and the peak of its
process tree's resident memory while the workload runs (the sum of `VmRSS` over the server and
all its descendants, whichever session they run in, sampled every 0.25 s; pages that processes
share count once per process). The machine's CPU time that other processes used meanwhile
(neither the server's tree nor this client) is printed below each table: on a shared machine,
a figure taken while others were busy is not comparable, llama.cpp's least (its threads wait for
each other at every step).

llama.cpp runs `--llamacpp-threads` threads, by default every CPU of this process's affinity.

`--llamacpp-python PYTHON` adds llama-cpp-python's OpenAI server (run by PYTHON, a virtual
environment with `llama-cpp-python[server]`), started once per round like triode; it runs one
request at a time, so at N streams N - 1 wait in its queue. It gets a table of its own.

Prints, per file and per stream count, each server's output tokens per second (all streams
together), each request's decode speed (1 / TPOT), TTFT p50 and p99, peak memory and start time,
and triode's ratio to llama.cpp for the speeds. With `--rounds R` each figure is the median over
the rounds and each ratio the median of the rounds' ratios, so that a shared machine's drift over
minutes, which moves both servers of a round alike, drops out. Absolute figures move with the
machine and the hour; the ratios of one run are what compare.

`llamacpp_server` starts and measures the servers, `llamacpp_report` writes the tables, and
`gguf_models` writes the files that `make bench-models` serves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from triode.wire.ports import free_port

from ..errors import leaf_errors
from .llamacpp_report import format_report
from .llamacpp_server import (
    LLAMA_SERVER,
    LLAMACPP_PYTHON,
    TRIODE,
    completion_body,
    llama_server_command,
    llamacpp_python_body,
    llamacpp_python_command,
    open_measured_server,
    run_workload,
    slot_context,
    triode_command,
)
from .process_tree import ProcessTree, cpu_ticks, machine_cpu_ticks
from .serve import concurrency_list, synthetic_prompts

MIB = 1 << 20


def triode_paths() -> tuple[Path, Path]:
    """triode's cache directory and its default GGUF file, as the model process's side of triode
    finds them (`$TRIODE_CACHE`, by default `~/.cache/triode`); the edge does not import it."""
    code = (
        "from triode.gpu.cache_paths import cache_dir, default_gguf; "
        "print(cache_dir()); print(default_gguf())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cache, gguf = done.stdout.split("\n")[:2]
    return Path(cache), Path(gguf)


def command_for(
    server: str, model: Path, args: argparse.Namespace, port: int, streams: int
) -> list[str]:
    """The command line that starts `server` on `port`, serving `model` to `streams` streams."""
    slot_ctx = slot_context(args.input_len, args.output_len)
    if server == LLAMA_SERVER:
        return llama_server_command(args.llama_server, model, port, streams=streams,
                                    threads=args.llamacpp_threads, slot_ctx=slot_ctx)  # fmt: skip
    if server == LLAMACPP_PYTHON:
        return llamacpp_python_command(
            args.llamacpp_python, model, port, threads=args.llamacpp_threads
        )
    return [*triode_command(model, port, max_model_len=slot_ctx), *args.triode_flags]


async def measure(
    server: str, model: Path, concurrencies: list[int], args: argparse.Namespace, round_: int
) -> list[dict[str, Any]]:
    """`server` started once on `model` and measured at each of `concurrencies`; a row each."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = command_for(server, model, args, port, max(concurrencies))
    print(f"round {round_}: starting {server} on {model.name}", file=sys.stderr)
    rows = []
    async with open_measured_server(command, base_url, ready_timeout=args.ready_timeout) as started:
        memory = started.memory
        for concurrency in concurrencies:
            prompts = synthetic_prompts(
                max(args.min_prompts, args.prompts_per_stream * concurrency),
                args.input_len,
                args.seed + concurrency,
            )
            print(f"{server}: {len(prompts)} requests at {concurrency} streams", file=sys.stderr)
            memory.phase = f"{concurrency} streams"
            memory.sample()
            before = cpu_snapshot(memory.tree)
            workload: dict[str, Any] = {
                "prompts": prompts,
                "output_len": args.output_len,
                "max_concurrency": concurrency,
            }
            if server == LLAMACPP_PYTHON:
                result = await run_workload(
                    base_url, llamacpp_python_body, counted=True, **workload
                )
            else:
                result = await run_workload(base_url, completion_body, **workload)
            others = others_cpu_pct(before, cpu_snapshot(memory.tree))
            memory.sample()
            result.update(server=server, file=model.name, concurrency=concurrency, round=round_,
                          start_s=started.start_s, start_rss_mib=memory.peaks["start"] / MIB,
                          peak_rss_mib=memory.peaks[memory.phase] / MIB,
                          others_cpu_pct=others)  # fmt: skip
            rows.append(result)
    return rows


def cpu_snapshot(tree: ProcessTree) -> tuple[int, int, int]:
    """(the machine's busy CPU ticks, all its CPU ticks, the ticks that the server's tree and
    this process used)."""
    busy, total = machine_cpu_ticks()
    return busy, total, tree.cpu_ticks() + cpu_ticks(os.getpid())


def others_cpu_pct(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """The share of the machine's CPU time between two `cpu_snapshot`s that neither the server
    nor this client used, in percent."""
    busy, total, ours = (b - a for a, b in zip(before, after, strict=True))
    return 100.0 * max(0, busy - ours) / total if total > 0 else 0.0


def servers_of(args: argparse.Namespace) -> list[str]:
    return [LLAMA_SERVER, TRIODE] + ([LLAMACPP_PYTHON] if args.llamacpp_python else [])


async def run_round(model: Path, args: argparse.Namespace, round_: int) -> list[dict[str, Any]]:
    """One round on `model`: each server in turn, the order rotated by the round; llama-server
    once per stream count, with that many slots."""
    servers = servers_of(args)
    shift = round_ % len(servers)
    rows: list[dict[str, Any]] = []
    for server in servers[shift:] + servers[:shift]:
        starts = (
            [[c] for c in args.concurrency_list]
            if server == LLAMA_SERVER
            else [args.concurrency_list]
        )
        for concurrencies in starts:
            # a server that does not start or fails its warm-up is reported, and the run goes on
            try:
                rows += await measure(server, model, concurrencies, args, round_)
            except* (RuntimeError, TimeoutError) as group:
                error = "\n".join(str(e) for e in leaf_errors(group))
                print(f"{server} on {model.name}: {error}", file=sys.stderr)
                rows.append({"server": server, "file": model.name, "round": round_,
                             "concurrency": None, "error": error})  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench llamacpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        type=Path,
        help="a GGUF file; may be given several times (default: the default model's)",
    )
    parser.add_argument(
        "--llama-server",
        metavar="PATH",
        help="llama.cpp's server (default: $TRIODE_CACHE/llama.cpp-build/bin/llama-server)",
    )
    parser.add_argument(
        "--llamacpp-python",
        "--llamacpp",  # its name when llama-cpp-python's was the only llama.cpp server here
        metavar="PYTHON",
        help="also run llama-cpp-python's server, by this Python with llama-cpp-python[server]",
    )
    parser.add_argument(
        "--llamacpp-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="llama.cpp's threads (default: every CPU of this process's affinity); its threads "
        "wait for each other at every step, so on CPUs that others use too, fewer run faster",
    )
    parser.add_argument(
        "--gguf-arithmetic",
        choices=("exact", "integer"),
        default="exact",
        help="triode's `--gguf-arithmetic` (integer: llama.cpp's arithmetic, not exact)",
    )
    parser.add_argument("--concurrencies", default="1,8,32", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="each server in turn, R times")
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=36, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=1800.0,
        help="seconds a server may take to start (triode converts a GGUF file on its first start)",
    )
    parser.add_argument("--json", type=Path, help="also write every round's rows here")
    args = parser.parse_args(argv)
    args.concurrency_list = concurrency_list(parser, args.concurrencies)
    args.triode_flags = ["--gguf-arithmetic", args.gguf_arithmetic]
    for name in ("rounds", "output_len", "input_len", "llamacpp_threads", "prompts_per_stream"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.llama_server is None or args.models is None:
        cache, gguf = triode_paths()
        server = cache / "llama.cpp-build" / "bin" / "llama-server"
        args.llama_server = args.llama_server or str(server)
        args.models = args.models or [gguf]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [
        row
        for model in args.models
        for round_ in range(args.rounds)
        for row in trio.run(run_round, model, args, round_)
    ]
    print(format_report(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
