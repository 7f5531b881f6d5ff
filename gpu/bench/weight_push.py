"""The trainer's side of `triode bench weights` (`triode.edge.bench.weights`), run as a child
process, as a trainer is one: it builds the benchmark's large random-weight model, or pushes a
checkpoint's tensors into a running server with `WeightSyncClient` and prints, as one JSON line,
how long the push took (the checkpoint is read before the clock starts).

    python -m triode.gpu.bench.weight_push build DIR [--hidden-size 1024 --layers 14]
    python -m triode.gpu.bench.weight_push push URL DIR --backend shm|broadcast
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..model_files import safetensors_weights
from ..tiny_model import build_tiny_model
from ..weight_transfer.client import WeightSyncClient


def build(directory: Path, hidden_size: int, layers: int) -> None:
    """A random-weight Llama of about (12 x hidden_size^2 + ...) x layers parameters in fp32:
    the defaults make about 1 GB."""
    build_tiny_model(
        directory,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=4,
        max_position_embeddings=2048,
    )
    print(json.dumps({"model": str(directory)}))


def push(url: str, directory: Path, backend: str, api_key: str | None) -> None:
    tensors = list(safetensors_weights(directory))
    size = sum(t.numel() * t.element_size() for _, t in tensors)
    started = time.perf_counter()
    with WeightSyncClient(url, api_key=api_key, backend=backend) as client:
        joined = time.perf_counter()
        version = client.update(tensors)
        done = time.perf_counter()
    result = {
        "backend": backend,
        "bytes": size,
        "tensors": len(tensors),
        "init_seconds": joined - started,
        "seconds": done - joined,
        "weight_version": version,
    }
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m triode.gpu.bench.weight_push")
    commands = parser.add_subparsers(dest="command", required=True)
    built = commands.add_parser("build", help="write the large random-weight model")
    built.add_argument("directory", type=Path)
    built.add_argument("--hidden-size", type=int, default=1024)
    built.add_argument("--layers", type=int, default=14)
    pushed = commands.add_parser("push", help="push a checkpoint into a server, timed")
    pushed.add_argument("url")
    pushed.add_argument("directory", type=Path)
    pushed.add_argument("--backend", choices=("shm", "broadcast"), required=True)
    pushed.add_argument("--api-key")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.directory, args.hidden_size, args.layers)
    else:
        push(args.url, args.directory, args.backend, args.api_key)


if __name__ == "__main__":
    main()
