"""How a CPU step's rows reach a model's weights: the row routing every projection shares
(`RowPaths`: torch's 4-bit kernel, AMX, or the dense weights), the dense weights in oneDNN's
blocked layout, and the fused C kernels handed to the modules that take them."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .cpu_kernels import FusedOps


class RowPaths:
    """How the rows of a step go through a model's projections; one instance shared by all of
    them (`share_row_paths`), set by the model runner before each forward.

    `decodes`: the step's leading rows, its decodes. A projection with 4-bit weights takes
    them through torch's 4-bit kernel (`int4.py`) when they are at most its
    `Int4Linear.max_rows`. Splitting by row, not by step, keeps a decode's arithmetic the same
    whether or not another request's prompt shares its step.

    `wide`: the other rows take the AMX 4-bit kernel where a projection has it (a row's result
    is the same at any row count there), else the dense weights.

    `dense_min`: the dense product runs on at least this many rows, zero-padded. oneDNN's
    bfloat16 kernels give a row the same result at any row count from 48 up, and other results
    below: a prompt's last tokens computed after a prefix-cache hit would then differ from the
    same tokens computed in a full prefill, and seeded sampling would depend on what the cache
    held. The runner sets it for steps with prompt tokens only; decode steps pay no padding.
    """

    decodes: int = 0
    wide: bool = True
    dense_min: int = 0


def row_invariant_from(model: nn.Module, most: int) -> int:
    """The fewest rows from which `model`'s dense products (`LinearBase.dense_rows`) give a
    row the same bits at any row count on this CPU, found by trying each projection shape once
    (`most` + 16 random rows against each count below `most`): 0 where every count does, so
    steps need no padding; `most` where a count just below it differs.

    oneDNN picks its bfloat16 kernel by the row count on some CPUs (where this was first seen,
    rows below 48 came out differently), not on others (on an AVX512-BF16 Zen 4 every count
    gives the same bits): padding where it is not needed costs a short prompt a 64-row product.
    """
    shapes: dict[tuple[int, int], Any] = {}
    for module in model.modules():
        if isinstance(getattr(type(module), "rows", None), RowPaths):  # `layers.LinearBase`
            if module.packed_only:  # only the file's blocks: no dense product to run
                continue
            shapes.setdefault((module.input_size, module.output_size), module)
    generator = torch.Generator().manual_seed(0)
    least = 0
    with torch.no_grad():
        for (cols, _), module in shapes.items():
            dtype = module.packed.dtype if module.packed is not None else module.weight.dtype
            x = torch.randn(most + 16, cols, generator=generator).to(dtype)
            whole = module.dense_rows(x, None)
            for n in range(most - 1, max(least, 1) - 1, -1):  # the largest count that differs
                if not torch.equal(module.dense_rows(x[:n], None), whole[:n]):
                    least = n + 1
                    break
    return least


# the most rows `few_rows_product` takes: from about here on MKL's own product catches up
FEW_ROWS = 64


def few_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x W^T for float32 CPU steps of up to `FEW_ROWS` rows, as (W x^T)^T; None elsewhere.

    MKL's float32 x W^T streams W badly when x has a few rows (decodes of a few requests, a
    request's verify rows): on a 2-core AVX2 EPYC, SmolLM2's projections took 101 ms a step at
    2 rows and 148 at 8; W x^T took 48 and 69, and 13 ms against 60 for the LM head's 49k rows
    at 5. A single row goes as two copies of itself: MKL's two-column product streams W faster
    than its matrix-vector one (71 ms against 93 for a step's products). Wide prompt chunks
    and other dtypes keep their own kernels, which have no such gap."""
    n = x.shape[0]
    if not 1 <= n <= FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if n == 1:
        return torch.mm(weight, torch.cat([x, x]).t())[:, :1].t().contiguous()
    return torch.mm(weight, x.t()).t().contiguous()


def use_fused_ops(model: nn.Module, ops: FusedOps | None) -> None:
    """Give every module of `model` that can take them the fused CPU kernels (`cpu_kernels`),
    or take them back (None)."""
    for module in model.modules():
        if "fused" in dir(type(module)):
            module.fused = ops


def share_row_paths(model: nn.Module) -> RowPaths:
    """One `RowPaths` for every projection of `model`, returned for the runner to set."""
    rows = RowPaths()
    for module in model.modules():
        if isinstance(getattr(type(module), "rows", None), RowPaths):  # `layers.LinearBase`
            module.rows = rows
    return rows


# the batch size oneDNN tunes the blocked layout for: measured on bfloat16 Llama projections,
# 64 is as fast as 1 for a single row and 1.5x faster than 1 from 256 rows up
_PACK_BATCH_HINT = 64


def cpu_weight_packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear for this dtype on this CPU: bfloat16 where the CPU computes
    in it natively. float32 stays on the plain path that the reference comparisons pin."""
    return dtype == torch.bfloat16 and _bfloat16_packing()


@functools.cache
def _bfloat16_packing() -> bool:
    """Whether oneDNN reorders bfloat16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, which an AVX2-only CPU lacks (it refuses there), so one tiny weight is
    tried once."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        pack_cpu_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered into oneDNN's blocked layout for `mkldnn._linear_pointwise`.

    Measured on SmolLM2's 30 layers of projections, 2 cores: 11.9 ms against 18.6 ms for the
    plain layout at 1 row, 17.8 against 27.0 at 64 (the same values, accumulated in float32
    either way).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack every linear projection of `model` for the CPU that is not packed yet (all of them
    after loading; those that took new weights after an update); returns how many were packed."""
    modules = [m for m in model.modules() if hasattr(m, "pack_for_cpu") and m.packed is None]
    for module in modules:
        module.pack_for_cpu()
    return len(modules)
