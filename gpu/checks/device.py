"""Check a machine for tensor/pipeline parallelism: `python -m triode.gpu.checks.device`.

It prints torch, CUDA and NCCL versions and the devices, then one markdown table:

- NCCL collectives on every GPU (`triode.gpu.checks.collective`): world = the device count. With
  one GPU the world is 1, since NCCL refuses two ranks on one device, and the send/recv ring and
  the parallel model checks are skipped.
- The same collectives with gloo on the CPU at world 2, for comparison.
- Greedy decoding of the default model (`triode.gpu.checks.parallel`), the model runner on every
  rank: TP=N (N = the device count), PP=2 and, with 4 GPUs or more, TP=2xPP=2, each against
  TP=1: the same tokens over 24 tokens of 4 prompts, and top-20 logprobs within 1e-4, float32.
  A random tiny model stands in when the default model is missing.
- Expert parallelism: a random tiny Qwen3-MoE (8 experts, top 2) at TP=N (at most 8; TP=2 on
  the CPU) with its experts split over the ranks, against TP=1 on the same terms.

Without a GPU it says so and exits 0 (2 with `--require-gpu`); with one, it exits 1 if any
check failed. `--cpu` runs only the model checks, on the CPU with gloo (TP=2, PP=2,
TP=2xPP=2 and TP=2+EP), GPU or not, and exits 1 if any failed. The whole run takes a few
minutes at most.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..loader import resolve_model
from ..local_group import RankError
from ..tiny_model import build_tiny_model, build_uneven_tiny_model
from .collective import CheckRow, check_collectives
from .parallel import check_parallel_greedy, greedy_row

CPU_SHAPES = ((2, 1), (1, 2), (2, 2))
# the expert-parallel row's model: 8 experts split over up to 8 ranks
TINY_MOE: dict[str, Any] = {
    "architecture": "qwen3_moe",
    "num_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
EXIT_NO_GPU = 2
_NOTE_LIMIT = 240


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.cpu:
        print(f"torch {torch.__version__}, CPU: {len(os.sched_getaffinity(0))} cores, gloo")
        print()
        rows = check_model("gloo", CPU_SHAPES, args.model)
        rows += check_expert_parallel("gloo", 2)
    elif not torch.cuda.is_available():
        print("no CUDA GPU present: nothing to check (NCCL needs one)")
        return EXIT_NO_GPU if args.require_gpu else 0
    else:
        world = torch.cuda.device_count()
        print(environment())
        if world == 1:
            print("one GPU: NCCL runs at world 1 (it refuses two ranks on one device)")
        print()
        rows = _collectives("nccl", world, args.iterations)
        rows += _collectives("gloo", 2, args.iterations)
        rows += check_model("nccl", gpu_shapes(world), args.model)
        if world >= 2:
            rows += check_expert_parallel("nccl", min(world, TINY_MOE["num_experts"]))
        rows += _skipped_shapes(world)
    print(format_table(rows))
    return 1 if any(row.failed for row in rows) else 0


def environment() -> str:
    """Versions and devices, one per line."""
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    return "\n".join(lines)


def _collectives(backend: str, world: int, iterations: int) -> list[CheckRow]:
    """The collective rows, or one failed row saying why the ranks did not finish."""
    try:
        return check_collectives(backend, world, iterations=iterations)
    except (RankError, TimeoutError) as e:
        print(f"{backend} collectives failed:\n{e}", file=sys.stderr)
        lines = str(e).strip().splitlines()
        return [CheckRow("collectives", backend, world, "", None, "FAIL", note=lines[-1])]


def gpu_shapes(world: int) -> list[tuple[int, int]]:
    """The (TP, PP) worlds that `world` GPUs hold: TP=world and PP=2, and TP=2xPP=2 from 4."""
    if world < 2:
        return []
    return [(world, 1), (1, 2), *([(2, 2)] if world >= 4 else [])]


def _skipped_shapes(world: int) -> list[CheckRow]:
    rows = []
    for name, need in (("TP=N", 2), ("PP=2", 2), ("TP=2xPP=2", 4), ("TP=N+EP", 2)):
        if world < need:
            note = f"needs >= {need} GPUs, found {world}"
            op = f"greedy {name} vs TP=1"
            rows.append(CheckRow(op, "nccl", world, "float32", None, "skip", None, note))
    return rows


def check_model(
    backend: str, shapes: Sequence[tuple[int, int]], model: str | None
) -> list[CheckRow]:
    """`parallel_check`'s rows for `model` (None: the default model, or a random tiny one
    when that is missing); a model that does not resolve fails every row."""
    if not shapes:
        return []
    with tempfile.TemporaryDirectory(prefix="triode-parallel-check-") as tmp:
        try:
            path, which = _model(model, Path(tmp))
        except Exception as e:
            return [
                greedy_row(tp, pp, backend, "FAIL", f"{type(e).__name__}: {e}") for tp, pp in shapes
            ]
        return check_parallel_greedy(path, shapes, backend=backend, which=which)


def check_expert_parallel(backend: str, tp: int) -> list[CheckRow]:
    """The TP=`tp`+EP row: a random tiny Qwen3-MoE whose experts the ranks split, against one
    rank."""
    with tempfile.TemporaryDirectory(prefix="triode-expert-parallel-check-") as tmp:
        try:
            model = build_tiny_model(Path(tmp) / "moe", **TINY_MOE)
        except Exception as e:
            return [greedy_row(tp, 1, backend, "FAIL", f"{type(e).__name__}: {e}", True)]
        which = "a random tiny Qwen3-MoE"
        return check_parallel_greedy(
            model, [(tp, 1)], backend=backend, which=which, expert_parallel=True
        )


def _model(model: str | None, tmp: Path) -> tuple[Path, str]:
    if model is not None:
        return resolve_model(model), str(model)
    try:
        return resolve_model(None), "the default model"
    except FileNotFoundError:
        pass
    tiny = build_uneven_tiny_model(tmp / "tiny")
    return tiny, "a random tiny model (the default model is missing: make model)"


def format_table(rows: Sequence[CheckRow]) -> str:
    """A markdown table with a row per check."""
    lines = [
        "| check | backend | world | dtype | elements | result | p50 µs | note |",
        "|---|---|---:|---|---:|---|---:|---|",
    ]
    for r in rows:
        cells = [
            r.op,
            r.backend,
            str(r.world),
            r.dtype,
            "" if r.numel is None else f"{r.numel:,}",
            r.status,
            "" if r.latency_us is None else f"{r.latency_us:,.1f}",
            _cell(r.note),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= _NOTE_LIMIT else text[: _NOTE_LIMIT - 1] + "…"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m triode.gpu.checks.device", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--require-gpu", action="store_true", help=f"exit {EXIT_NO_GPU} when there is no GPU"
    )
    where.add_argument(
        "--cpu", action="store_true", help="only the model checks, on the CPU with gloo"
    )
    parser.add_argument("--iterations", type=int, default=50, help="timed calls per collective")
    parser.add_argument(
        "--model",
        help="a model directory or .gguf file for the model checks (default: the default model)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
