"""How fast `gguf_kernels.matmul` multiplies a few rows by GGUF blocks, beside torch's dense
products on the same shapes: `python -m triode.gpu.bench.gguf_kernels`.

Per weight type, shape [outputs, cols] and row count: the time of a call (the fastest of
`--calls`: on a shared machine a thread that waits for its core makes the median the
neighbours' measure), and the weight bytes it reads over that time (GB/s), for float32 and
bfloat16 rows, and for the types with one, the integer mode's (`matmul_int8`, float32 rows);
then torch's `x @ W.T` over float32 and bfloat16 weights of the shape. A decode
step of one row reads every weight once and does little with it, so at one row the rate to
approach is the memory's.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .. import gguf_kernels

TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SHAPES = ((2048, 2048), (8192, 2048))
ROWS = (1, 8)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    if not gguf_kernels.available():
        print("the CPU kernels are not built")
        return 1
    print(f"torch threads: {torch.get_num_threads()}; ms per call, GB/s of weights read")
    print()
    print(
        "| weights | shape | rows | f32 ms | f32 GB/s | bf16 ms | bf16 GB/s | int8 ms | int8 GB/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for outputs, cols in args.shapes:
        for name in args.types:
            data = random_blocks(TYPES[name], outputs, cols)
            for rows in args.rows:
                cells = []
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(rows, cols).to(dtype)
                    call = functools.partial(gguf_kernels.matmul, x, data, TYPES[name], outputs)
                    seconds = _fastest(call, args.calls)
                    cells += [f"{seconds * 1e3:.3f}", f"{data.numel() / seconds / 1e9:.1f}"]
                if TYPES[name] in gguf_kernels.INT8_TYPES:
                    x = torch.randn(rows, cols)
                    call = functools.partial(
                        gguf_kernels.matmul_int8, x, data, TYPES[name], outputs
                    )
                    seconds = _fastest(call, args.calls)
                    cells += [f"{seconds * 1e3:.3f}", f"{data.numel() / seconds / 1e9:.1f}"]
                else:
                    cells += ["", ""]
                print(f"| {name} | {outputs}x{cols} | {rows} | " + " | ".join(cells) + " |")
        for rows in args.rows:
            cells = []
            for dtype in (torch.float32, torch.bfloat16):
                w = torch.randn(outputs, cols).to(dtype)
                x = torch.randn(rows, cols).to(dtype)
                seconds = _fastest(functools.partial(torch.matmul, x, w.T), args.calls)
                nbytes = w.numel() * w.element_size()
                cells += [f"{seconds * 1e3:.3f}", f"{nbytes / seconds / 1e9:.1f}"]
            print(f"| torch dense | {outputs}x{cols} | {rows} | " + " | ".join(cells) + " | | |")
    return 0


def random_blocks(kind: int, outputs: int, cols: int) -> torch.Tensor:
    """Random codes with every block's float16 fields (scales, minimums) 0.01: the speed of a
    product does not depend on its values, as long as they are normal floats."""
    size, nbytes = gguf_kernels.block_size(kind), gguf_kernels.block_bytes(kind)
    blocks = np.random.default_rng(0).integers(0, 256, (outputs, cols // size, nbytes), np.uint8)
    half = np.full((outputs, cols // size, 1), 0.01, np.float16).view(np.uint8)
    for offset in _HALVES[kind]:
        blocks[:, :, offset : offset + 2] = half
    return torch.from_numpy(blocks.reshape(outputs, -1))


# byte offsets of each block's float16 fields
_HALVES = {2: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def _fastest(call: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m triode.gpu.bench.gguf_kernels", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--types", nargs="+", choices=list(TYPES), default=list(TYPES))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument(
        "--shapes", type=_shape, nargs="+", default=list(SHAPES), help="OUTPUTSxCOLS ..."
    )
    parser.add_argument("--calls", type=int, default=50, help="timed calls per cell")
    parser.add_argument("--threads", type=int, default=2, help="torch's threads")
    return parser.parse_args(argv)


def _shape(text: str) -> tuple[int, int]:
    outputs, cols = text.lower().split("x")
    return int(outputs), int(cols)


if __name__ == "__main__":
    raise SystemExit(main())
