"""Correctness and latency of the collectives tensor and pipeline parallelism use.

`check_collectives(backend, world)` runs, on `world` real ranks (`triode.gpu.local_group`):
all_reduce (sum; float32 and bfloat16; 576, 576*64 and 1<<20 elements: one token's hidden
state, 64 tokens', and a large buffer), all_gather, broadcast, and a send/recv ring (rank r sends
to r+1 mod world). Each result is compared for exact equality with what it must be, and each op
is timed: the median of `iterations` back-to-back calls after a warm-up, each call synchronised
(CUDA) before the clock stops. A row's latency is the slowest rank's median.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Literal

import torch
import torch.distributed as dist

from ..local_group import Rank, run_ranks

ALL_REDUCE_SIZES = (576, 576 * 64, 1 << 20)
ALL_REDUCE_DTYPES = (torch.float32, torch.bfloat16)
OTHER_SIZE = 576 * 64  # all_gather, broadcast and send/recv: 64 tokens' hidden state
WARMUP = 5

Status = Literal["pass", "FAIL", "skip", "not available"]


@dataclass(frozen=True)
class CheckRow:
    """One check's outcome; `latency_us` is None where nothing was timed."""

    op: str
    backend: str
    world: int
    dtype: str
    numel: int | None
    status: Status
    latency_us: float | None = None
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


# What a rank returns per check: op, dtype, numel, error (None when exact), latency µs or None.
_RankRow = tuple[str, str, int, str | None, float | None]


def check_collectives(
    backend: str, world: int, *, iterations: int = 50, timeout: float = 120.0
) -> list[CheckRow]:
    """Every collective check on `world` ranks of `backend` ("nccl": rank r on cuda:r; "gloo":
    CPU). Raises what `run_ranks` raises when a rank dies or the group hangs."""
    per_rank: list[list[_RankRow]] = run_ranks(
        _rank_checks, iterations, backend=backend, world=world, timeout=timeout
    )
    rows = []
    for i, (op, dtype, numel, _, _) in enumerate(per_rank[0]):
        outcomes = [checks[i] for checks in per_rank]
        errors = [f"rank {r}: {o[3]}" for r, o in enumerate(outcomes) if o[3] is not None]
        latencies = [o[4] for o in outcomes if o[4] is not None]
        rows.append(
            CheckRow(
                op,
                backend,
                world,
                dtype,
                numel,
                "FAIL" if errors else "pass",
                max(latencies) if latencies else None,
                "; ".join(errors),
            )
        )
    if world == 1:
        ring = CheckRow(
            "send/recv ring", backend, 1, "float32", OTHER_SIZE, "skip", None, "needs 2 ranks"
        )
        rows.append(ring)
    return rows


def _rank_checks(me: Rank, iterations: int) -> list[_RankRow]:
    rows: list[_RankRow] = []
    for dtype in ALL_REDUCE_DTYPES:
        for numel in ALL_REDUCE_SIZES:
            rows.append(_all_reduce(me, dtype, numel, iterations))
    rows.append(_all_gather(me, OTHER_SIZE, iterations))
    rows.append(_broadcast(me, OTHER_SIZE, iterations))
    if me.world > 1:
        rows.append(_ring(me, OTHER_SIZE, iterations))
    return rows


def _pattern(me: Rank, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers, so that every partial sum of an all_reduce stays below 256 and is exact
    # in bfloat16 whatever order the backend adds in: equality can be exact.
    modulus = max(2, 256 // (me.world * (me.world + 1) // 2))
    return (torch.arange(numel, device=me.device) % modulus).to(dtype)


def _all_reduce(me: Rank, dtype: torch.dtype, numel: int, iterations: int) -> _RankRow:
    base = _pattern(me, numel, dtype)
    x = base * (me.rank + 1)
    dist.all_reduce(x)
    error = _mismatch(x, base * (me.world * (me.world + 1) // 2))
    buffer = torch.zeros(numel, dtype=dtype, device=me.device)  # stays finite across repeats
    latency = _median_us(me, lambda: dist.all_reduce(buffer), iterations)
    return ("all_reduce", _name(dtype), numel, error, latency)


def _all_gather(me: Rank, numel: int, iterations: int) -> _RankRow:
    base = _pattern(me, numel, torch.float32)
    out = [torch.empty_like(base) for _ in range(me.world)]
    dist.all_gather(out, base + me.rank)
    errors = [f"from rank {r}: {e}" for r, t in enumerate(out) if (e := _mismatch(t, base + r))]
    mine = base + me.rank
    latency = _median_us(me, lambda: dist.all_gather(out, mine), iterations)
    return ("all_gather", "float32", numel, "; ".join(errors) or None, latency)


def _broadcast(me: Rank, numel: int, iterations: int) -> _RankRow:
    base = _pattern(me, numel, torch.float32)
    x = base.clone() if me.rank == 0 else torch.full_like(base, -1.0)
    dist.broadcast(x, src=0)
    latency = _median_us(me, lambda: dist.broadcast(x, src=0), iterations)
    return ("broadcast", "float32", numel, _mismatch(x, base), latency)


def _ring(me: Rank, numel: int, iterations: int) -> _RankRow:
    base = _pattern(me, numel, torch.float32)
    after, before = (me.rank + 1) % me.world, (me.rank - 1) % me.world
    sent, received = base + me.rank, torch.full_like(base, -1.0)

    def exchange() -> None:
        # Posted together: NCCL needs a send and its matching receive in one group, or a ring
        # of blocking sends deadlocks.
        ops = [dist.P2POp(dist.isend, sent, after), dist.P2POp(dist.irecv, received, before)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    exchange()
    error = _mismatch(received, base + before)
    latency = _median_us(me, exchange, iterations)
    return ("send/recv ring", "float32", numel, error, latency)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when `got` equals `want` exactly, else where and how they differ."""
    if torch.equal(got, want):
        return None
    wrong = (got != want).nonzero().flatten()
    first = int(wrong[0])
    return (
        f"{len(wrong)} of {want.numel()} elements differ, the first at {first}: "
        f"{got[first].item()} != {want[first].item()}"
    )


def _median_us(me: Rank, op: Callable[[], object], iterations: int) -> float:
    for _ in range(WARMUP):
        op()
    _synchronize(me.device)
    samples = []
    for _ in range(iterations):
        start = perf_counter_ns()
        op()
        _synchronize(me.device)
        samples.append((perf_counter_ns() - start) / 1e3)
    return sorted(samples)[len(samples) // 2]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
