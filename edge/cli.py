"""The `triode` command line."""

from __future__ import annotations

import argparse
import runpy
import sys
from importlib.metadata import version

BENCHMARKS = {"wire": "triode.wire.bench", "throughput": "triode.edge.bench_throughput"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triode", description="LLM inference on trio actors")
    parser.add_argument("--version", action="version", version=f"triode {version('triode')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("serve", help="serve the OpenAI API (not available yet)")
    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    args = parser.parse_args(argv)

    if args.command == "serve":
        print(
            "triode serve is not available yet: the HTTP edge is still to come.",
            file=sys.stderr,
        )
        return 1
    if args.command == "bench":
        sys.argv = [f"triode bench {args.which}", *args.args]
        runpy.run_module(BENCHMARKS[args.which], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
