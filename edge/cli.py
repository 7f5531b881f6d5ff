"""The `triode` command line: the top-level parser, and dispatch to each subcommand (those with
options of their own are in `commands/`; the benchmarks and fuzzers parse their own)."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import version
from typing import NamedTuple

from triode.wire.cluster_key import ClusterKey

from .commands import proxy, replay, serve


class Benchmark(NamedTuple):
    module: str  # imported when run; its `main(argv)` parses the rest of the command line
    summary: str


BENCHMARKS = {
    "serve": Benchmark(
        "triode.edge.bench.serve", "a server under streamed load, as vllm bench serve"
    ),
    "ab": Benchmark("triode.edge.bench.ab", "this tree against a baseline checkout, served"),
    "vllm": Benchmark("triode.edge.bench.vllm", "triode beside vLLM's CPU build, 1 to 64 streams"),
    "llamacpp": Benchmark(
        "triode.edge.bench.llamacpp", "triode beside llama.cpp's llama-server on GGUF files"
    ),
    "embed": Benchmark(
        "triode.edge.bench.embed", "/v1/embeddings against sentence-transformers and vLLM"
    ),
    "frontend": Benchmark(
        "triode.edge.bench.frontend", "the API servers alone, 1, 2, 4 ... processes"
    ),
    "throughput": Benchmark(
        "triode.edge.bench.throughput", "offline generation against transformers"
    ),
    "structured": Benchmark("triode.edge.bench.structured", "what constrained decoding costs"),
    "weights": Benchmark("triode.edge.bench.weights", "new weights and sleep, against a restart"),
    "lora": Benchmark("triode.edge.bench.lora", "LoRA adapters, one and mixed, against the base"),
    "moe": Benchmark(
        "triode.edge.bench.moe", "a 1.3 B mixture of experts: transformers, TP, expert parallel"
    ),
    "moe-dispatch": Benchmark(
        "triode.gpu.bench.moe", "one MoE block: TP against expert parallel's two dispatches"
    ),
    "fleet": Benchmark(
        "triode.edge.bench.fleet", "instances behind vllm-router: round robin, cache- and KV-aware"
    ),
    "spec": Benchmark("triode.edge.bench.spec", "speculative decoding against none, served"),
    "step": Benchmark("triode.gpu.bench.step", "one decode step at several batch sizes, profiled"),
    "collectives": Benchmark(
        "triode.gpu.bench.collectives", "tensor and pipeline parallelism's exchanges"
    ),
    "kv-transfer": Benchmark(
        "triode.gpu.bench.kv_transfer", "the KV connector's transports against memcpy"
    ),
    "wire": Benchmark(
        "triode.wire.bench", "the codec and the ZMQ adapter against pickle and raw pyzmq"
    ),
}


def _make_cluster_key(path: str) -> int:
    try:
        ClusterKey.generate().write(path)
    except OSError as e:
        print(f"triode cluster-key: {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {path}: give every node the same file with --cluster-key-file {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triode", description="LLM inference on trio actors")
    parser.add_argument("--version", action="version", version=f"triode {version('triode')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(commands)
    proxy.add_parser(commands)
    replay.add_parser(commands)
    cluster_key = commands.add_parser(
        "cluster-key",
        help="make the key file that the nodes of a multi-node world share",
        description="Write a new CurveZMQ key to PATH (created 0600; never over an existing "
        "file). Copy it to every node and give it to each `triode serve` with "
        "--cluster-key-file PATH.",
    )
    cluster_key.add_argument("path", metavar="PATH")
    bench = commands.add_parser(
        "bench",
        help="run a benchmark and print its table",
        description="Run a benchmark; `triode bench NAME --help` lists its options.",
        epilog="benchmarks:\n"
        + "\n".join(f"  {name:<12} {b.summary}" for name, b in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("which", choices=list(BENCHMARKS), metavar="NAME", help="one of those below")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    fuzz = commands.add_parser(
        "fuzz",
        help="fuzz a live server (HTTP) or engine core (ZMQ), or kill its processes under load",
        description="Send hostile traffic for a while, checking invariants between rounds; "
        "exit status 1 on a violation. `triode fuzz MODE --help` lists the options.",
    )
    fuzz.add_argument("mode", choices=["http", "zmq", "all", "replay", "chaos"])
    fuzz.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the fuzzer")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "serve":
        return serve.run(args)
    if args.command == "proxy":
        return proxy.run(args)
    if args.command == "cluster-key":
        return _make_cluster_key(args.path)
    if args.command == "replay":
        return replay.run(args)
    if args.command == "fuzz":
        return importlib.import_module("triode.fuzz.live").main([args.mode, *args.args])
    if args.command == "bench":
        importlib.import_module(BENCHMARKS[args.which].module).main(args.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
