"""What LoRA adds to a decode step's projections: SmolLM2-135M's 30 layers of Q/K/V, O,
gate/up and down projections (our merged modules, random weights) over 32 decode rows, timed
without adapters, with one adapter over every row, and with 4 adapters of 8 rows each (rank 16,
all seven projections targeted); and, beside the run-by-run deltas, the same 4 adapters
computed by gathering each row's pair (`torch.bmm` over rows, the grouping a gather-based
kernel would use).

    python -m triode.gpu.bench.lora_overhead [--rows 32] [--rank 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ..layers import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..lora.punica import LoraRuns, ModuleLora
from ..models.llama import parameter_defaults

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 576, 1536, 30, 9, 3


def _projections() -> list[LinearBase]:
    head = HIDDEN // HEADS
    modules: list[LinearBase] = []
    for _ in range(LAYERS):
        modules += [
            QKVParallelLinear(HIDDEN, head, HEADS, KV_HEADS, bias=False),
            RowParallelLinear(HIDDEN, HIDDEN),
            MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE, INTERMEDIATE]),
            RowParallelLinear(INTERMEDIATE, HIDDEN),
        ]
    for module in modules:
        module.weight.data.normal_(std=0.02)
    return modules


def _pairs(modules: list[LinearBase], rank: int) -> list[ModuleLora | None]:
    """One adapter: every projection targeted (merged ones with a block-diagonal B)."""
    shards = {QKVParallelLinear: 3, MergedColumnParallelLinear: 2}
    pairs: list[ModuleLora | None] = []
    for m in modules:
        r = rank * shards.get(type(m), 1)
        pairs.append(ModuleLora(torch.randn(m.input_size, r) * 0.02, torch.randn(r, m.output_size)))
    return pairs


def _time(step: Callable[[], None], repeats: int) -> float:
    step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with parameter_defaults(dtype, torch.device("cpu")), torch.inference_mode():
        modules = _projections()
        runs = LoraRuns()
        for slot, module in enumerate(modules):
            module.lora, module.lora_slot = runs, slot
        adapters = [_pairs(modules, args.rank) for _ in range(args.adapters)]
        xs = {m.input_size: torch.randn(args.rows, m.input_size) for m in modules}

        def step() -> None:
            for m in modules:
                m(xs[m.input_size])

        base = _time(step, args.repeats)
        runs.runs = [(0, args.rows, adapters[0])]
        one = _time(step, args.repeats)
        size = args.rows // args.adapters
        runs.runs = [(i * size, (i + 1) * size, a) for i, a in enumerate(adapters)]
        several = _time(step, args.repeats)
        runs.runs = []
        rows_of = torch.arange(args.rows) // size

        def gathered() -> None:
            for slot, m in enumerate(modules):
                x = xs[m.input_size]
                y = m(x)
                a = torch.stack([ad[slot].a_t for ad in adapters])[rows_of]  # type: ignore[union-attr]
                b = torch.stack([ad[slot].b_t for ad in adapters])[rows_of]  # type: ignore[union-attr]
                y += torch.bmm(torch.bmm(x[:, None], a), b)[:, 0]

        gather = _time(gathered, args.repeats)
    print(
        f"{args.rows} decode rows, rank {args.rank}, {args.dtype}, {torch.get_num_threads()} "
        f"threads: projections {base:.2f} ms/step; +1 adapter {one - base:.2f} ms; "
        f"+{args.adapters} adapters in runs {several - base:.2f} ms; "
        f"+{args.adapters} adapters gathered per row {gather - base:.2f} ms"
    )


if __name__ == "__main__":
    main()
