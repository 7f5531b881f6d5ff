"""`triode bench kv-transfer`: the KV connector's transports against a plain memcpy.

One process, real sockets: a KV server over a cache of the default model's geometry (30 layers,
3 KV heads of 64, bfloat16, blocks of 16) exposes a prompt's blocks, and a loader copies them
into a second cache, over TCP (ZMQ, loopback) and over shared memory (the memfd handed over a
unix socket, then mapped), each beside a `torch` copy of the same bytes from one cache into the
other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from triode.wire.kv_transfer import KVExpose, KVLoad

from ..kv.loader import KVLoader
from ..kv.shm import shared_cache
from ..kv.transport import KVServer, block_bytes


def _measure(args: argparse.Namespace, transport: str) -> tuple[float, float]:
    """(transport GB/s, memcpy GB/s), medians over the repeats."""
    shape = (args.layers, 2, args.blocks * 2, 16, args.kv_heads, args.head_dim)
    if transport == "shm":
        source, fd = shared_cache(shape, torch.bfloat16)
    else:
        source, fd = torch.zeros(shape, dtype=torch.bfloat16), None
    source.normal_()
    target = torch.zeros(shape, dtype=torch.bfloat16)
    secret = os.urandom(32)
    server = KVServer("tcp://127.0.0.1:*", source, engine_id="bench", secret=secret, shm_fd=fd)
    loader = KVLoader(0, target, timeout=30.0, secret=secret)
    ids = list(range(args.blocks))
    size = len(ids) * block_bytes(server.geometry)
    rates, copies = [], []
    try:
        for i in range(args.repeats):
            server.expose([KVExpose(f"r{i}", ids, "s")])
            started = time.perf_counter()
            loader.submit(
                KVLoad(f"r{i}", [b + args.blocks for b in ids], ids, f"r{i}", "bench",
                       [server.endpoint], "s", transport)
            )  # fmt: skip
            while not any(loader.take()):
                time.sleep(0.0002)
            rates.append(size / (time.perf_counter() - started) / 1e9)
            dst = torch.tensor([b + args.blocks for b in ids])
            started = time.perf_counter()
            target.index_copy_(2, dst, source.index_select(2, torch.tensor(ids)))
            copies.append(size / (time.perf_counter() - started) / 1e9)
        assert torch.equal(target[:, :, args.blocks :], source[:, :, : args.blocks])
    finally:
        server.close()
        loader.close()
        if fd is not None:
            os.close(fd)
    return statistics.median(rates), statistics.median(copies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="triode bench kv-transfer", description=__doc__)
    parser.add_argument("--blocks", type=int, default=94, help="a 1,500-token prompt's")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    mb = args.blocks * 16 * args.layers * 2 * args.kv_heads * args.head_dim * 2 / 1e6
    print(f"{args.blocks} blocks, {mb:.1f} MB per transfer, median of {args.repeats}")
    print(f"{'transport':<10} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>7}")
    for transport in ("tcp", "shm"):
        rate, copy = _measure(args, transport)
        print(f"{transport:<10} {rate:>8.2f} {copy:>12.2f} {rate / copy:>7.2f}")


if __name__ == "__main__":
    main()
