"""What a mixture-of-experts block costs under each way of splitting it: `python -m
triode.gpu.bench.moe`.

Two gloo ranks in two processes on this machine, one torch thread each, as a TP group of two
(`parallel_state.init_groups`, so the sums take the shared-memory all-reduce the engine uses),
run one `SparseMoeBlock` forward over the same random hidden states, timed on rank 0:

- TP=1: the whole block on rank 0 alone, before the group forms (the baseline);
- TP=2: every expert's intermediate dimension split, one all-reduce;
- EP allreduce: whole experts split, every rank routes every token, one all-reduce;
- EP all_to_all: whole experts split, each rank routes its half of the tokens and exchanges
  pairs with the experts' ranks, then the halves are all-gathered.

Every block holds the same experts (one seeded checkpoint, loaded as each split cuts it), and
the run fails unless the four give the same output within float32 rounding. The shape is the
`triode bench moe` model's: 64 experts of intermediate size 256, top 4, hidden 1024.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from .. import parallel_state
from ..local_group import Rank, run_ranks
from ..models.moe import Dispatch, SparseMoeBlock
from ..parallel_state import ParallelLayout

HIDDEN = 1024
EXPERTS = 64
INTERMEDIATE = 256
TOP_K = 4
TOKENS = (1, 8, 64, 256)
WORLD = 2
TIMEOUT = 600.0
TP1 = "TP=1"
# (column, expert parallel, dispatch) of the two-rank splits
SPLITS: tuple[tuple[str, bool, Dispatch], ...] = (
    ("TP=2", False, "allreduce"),
    ("EP allreduce", True, "allreduce"),
    ("EP all_to_all", True, "all_to_all"),
)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    tokens = tuple(args.tokens)
    per_rank = run_ranks(
        _rank, tokens, args.rounds, args.calls, backend="gloo", world=WORLD, threads=1,
        timeout=TIMEOUT,
    )  # fmt: skip
    medians: dict[str, dict[int, float]] = per_rank[0]
    columns = [TP1, *(name for name, _, _ in SPLITS)]
    print(
        f"median ms of one block forward ({args.rounds} rounds of {args.calls} calls, the "
        f"splits in turn); gloo, {WORLD} ranks of 1 thread; {EXPERTS} experts of intermediate "
        f"size {INTERMEDIATE}, top {TOP_K}, hidden {HIDDEN}, float32"
    )
    print()
    print("| tokens | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for n in tokens:
        print(f"| {n} | " + " | ".join(f"{medians[c][n]:.2f}" for c in columns) + " |")
    return 0


def _rank(
    me: Rank, tokens: tuple[int, ...], rounds: int, calls: int
) -> dict[str, dict[int, float]]:
    """Rank 0's median ms per split and token count: for each token count, `rounds` rounds
    that time `calls` calls of each split in turn (drift on a shared machine falls on every
    split alike); the median of the rounds' medians. Both ranks take part in every call of a
    two-rank split; rank 1 waits in the next one while rank 0 runs TP=1 alone."""
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * INTERMEDIATE**-0.5
    gate = torch.randn(EXPERTS, HIDDEN) * HIDDEN**-0.5
    blocks: dict[str, SparseMoeBlock] = {}
    if me.rank == 0:  # a world of one until the groups form
        blocks[TP1] = _block(gate, w13, w2, False, "allreduce")
    parallel_state.init_groups(
        ParallelLayout(WORLD, 1, me.rank), collective_timeout=TIMEOUT, device=me.device
    )
    try:
        for name, expert_parallel, dispatch in SPLITS:
            blocks[name] = _block(gate, w13, w2, expert_parallel, dispatch)
        medians: dict[str, dict[int, float]] = {name: {} for name in blocks}
        with torch.inference_mode():
            for n in tokens:
                x = torch.randn(n, HIDDEN)
                outputs = {name: block(x) for name, block in blocks.items()}  # and a warm-up
                if me.rank == 0:
                    for name in blocks:
                        torch.testing.assert_close(outputs[name], outputs[TP1], msg=name)
                times: dict[str, list[float]] = {name: [] for name in blocks}
                for _ in range(rounds):
                    for name, block in blocks.items():
                        times[name].append(_median_ms(block, x, calls))
                for name in blocks:
                    medians[name][n] = statistics.median(times[name])
    finally:
        parallel_state.destroy_distributed()
    return medians


def _median_ms(block: SparseMoeBlock, x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        block(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _block(
    gate: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_parallel: bool,
    dispatch: Dispatch,
) -> SparseMoeBlock:
    """A block over the experts `w13`, `w2`, each rank holding what the split gives it."""
    block = SparseMoeBlock(
        HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, expert_parallel=expert_parallel,
        dispatch=dispatch,
    )  # fmt: skip
    block.gate.weight.copy_(gate)
    experts = block.experts
    for e in range(experts.first, experts.first + experts.count):
        gate_rows, up_rows = w13[e].chunk(2)
        experts.weight_loader(experts.w13, gate_rows, (e, "gate"))
        experts.weight_loader(experts.w13, up_rows, (e, "up"))
        experts.weight_loader(experts.w2, w2[e], (e, "down"))
    return block


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m triode.gpu.bench.moe", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each split in turn")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per split and round")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
