"""A step's LoRA deltas, Punica-style: the step's rows come ordered so that each adapter's rows
form a few contiguous runs, and every projection adds, run by run, one shrink and one expand of
that adapter's pair to its base product, on views of the rows (no gather, no copy).

A merged projection (Q/K/V, gate/up) holds one pair per adapter: A stacks the targeted shards'
A matrices and B is block-diagonal over its output slices, so one shrink and one expand cover
all of its shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModuleLora:
    """One adapter's pair for one projection on this rank, scaling folded into B:
    y += (x @ a_t) @ b_t, with `a_t` [in, R] and `b_t` [R, out] (R the targeted shards' ranks
    summed)."""

    a_t: torch.Tensor
    b_t: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_t, self.b_t))


# each adapter's pairs by projection slot (`LinearBase.lora_slot`); None: not targeted
SlotWeights = list[ModuleLora | None]


class LoraRuns:
    """The step's [lo, hi) row runs of each adapter, with that adapter's pairs; one instance
    shared by every projection of a model (`LoraStore.share`), set by the runner before each
    forward. Rows of the base model are in no run; a step without adapters has no runs, and a
    projection then pays one attribute check."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, SlotWeights]] = []

    def add_delta(self, slot: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[lo:hi] += (x[lo:hi] @ A^T) @ B^T for each run whose adapter targets projection
        `slot`; a run covering every row takes x and y whole."""
        rows = x.shape[0]
        for lo, hi, weights in self.runs:
            pair = weights[slot]
            if pair is None:
                continue
            if hi - lo == rows:
                xs, ys = x, y
            else:
                xs, ys = x[lo:hi], y[lo:hi]
            if pair.a_t.dtype == x.dtype:
                ys.addmm_(xs @ pair.a_t, pair.b_t)
            else:  # adapters kept in another dtype than the model's (`lora_dtype`)
                ys += ((xs.to(pair.a_t.dtype) @ pair.a_t) @ pair.b_t).to(ys.dtype)


def adapter_runs(row_adapters: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[lo, hi, lora_id) runs from (rows, lora_id) of consecutive requests in row order:
    neighbours of the same adapter merge; the base model's rows (id 0) are in none."""
    runs: list[tuple[int, int, int]] = []
    lo = 0
    for count, lora_id in row_adapters:
        hi = lo + count
        if lora_id:
            if runs and runs[-1][1] == lo and runs[-1][2] == lora_id:
                runs[-1] = (runs[-1][0], hi, lora_id)
            else:
                runs.append((lo, hi, lora_id))
        lo = hi
    return runs
