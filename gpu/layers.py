"""Tensor-parallel building blocks for decoder-only transformers.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's shard out of a full checkpoint tensor, so a model loads the same Hugging Face files at any
tensor-parallel size. The rank, size and group come from `parallel_state` (workers run one rank
per process, in one tensor-parallel group per pipeline stage); elsewhere this is rank 0 of 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import parallel_state
from .cpu_kernels import FUSED_DTYPES
from .cpu_paths import RowPaths, few_rows_product, pack_cpu_weight
from .int4 import Int4Linear
from .lora.punica import LoraRuns
from .models.architectures import CheckpointMismatch
from .quant_matmul import Quantized, QuantRows, quantized_kernel

if TYPE_CHECKING:
    from .cpu_kernels import FusedOps

WeightLoader = Callable[..., None]


def tp_rank() -> int:
    return parallel_state.layout().tp_rank


def tp_size() -> int:
    return parallel_state.layout().tp_size


def tp_group() -> dist.ProcessGroup | None:
    return parallel_state.get().tp_group


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """A replicated parameter: the checkpoint tensor is the whole parameter."""
    if param.shape != loaded_weight.shape:
        raise CheckpointMismatch(
            f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def _parameter(shape: tuple[int, ...], loader: WeightLoader, **attrs: Any) -> nn.Parameter:
    """An uninitialised parameter (the checkpoint fills it) carrying its loader."""
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [out, in], sharded along `tp_dim` (0: out, 1: in)."""

    packed: torch.Tensor | None = None  # W in oneDNN's layout once `pack_for_cpu` ran
    int4: Int4Linear | None = None  # W's 4-bit codes for torch's and AMX's kernels (`int4.py`)
    quant: QuantRows | None = None  # W's GGUF blocks for the decode rows (`quant_matmul.py`)
    stored: Quantized | None = None  # W as the GGUF file stores it, where a kernel took it
    rows: RowPaths = RowPaths()  # the model's, once the runner shares it (`share_row_paths`)
    lora: LoraRuns = LoraRuns()  # the step's adapter runs, once shared (`LoraStore.share`)
    lora_slot: int = -1  # this projection's index in each adapter's weights

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """`shard` is this rank's (start, size) along `tp_dim` of the checkpoint tensor; by
        default the rank's equal share."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.tp_dim = tp_dim
        self.shard = shard
        self.input_size, self.output_size = input_size, output_size
        self.weight = _parameter((output_size, input_size), self.weight_loader)
        self.bias = _parameter((output_size,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded_weight.dim():
            if self.shard is not None:
                loaded_weight = loaded_weight.narrow(self.tp_dim, *self.shard)
            else:
                loaded_weight = loaded_weight.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        if self.lora.runs:
            self.lora.add_delta(self.lora_slot, x, y)
        return y

    def lora_part(
        self, a: torch.Tensor, b: torch.Tensor, shard_id: str | int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one LoRA pair of a checkpoint projection (A [r, in], B
        [out, r]; `shard_id` the projection's shard of a merged one): a column-parallel
        projection keeps A whole and B's rows cut as the base weight's rows are; a row-parallel
        one cuts A's columns as the base weight's input columns and keeps B whole, its partial
        delta summed by the same all-reduce as the base product."""
        if self.tp_size == 1 or self.tp_dim is None:
            return a, b
        if self.tp_dim == 0:
            return a, b.narrow(0, *self._output_rows(shard_id, b.shape[0]))
        size = a.shape[1] // self.tp_size
        return a.narrow(1, *(self.shard or (self.tp_rank * size, size))), b

    def local_rows(self, shard_id: str | int | None = None) -> tuple[int, int]:
        """(offset, size) of shard `shard_id`'s rows in this rank's output."""
        return 0, self.output_size

    def quantized_part(self, weight: Quantized, shard_id: str | int | None = None) -> Quantized:
        """This rank's part of a checkpoint's whole quantized weight (one shard of a merged
        projection), cut where `weight_loader` cuts the dense one. ValueError where the cut
        falls inside a block of 32 inputs."""
        if self.tp_size == 1 or self.tp_dim is None:
            return weight
        if self.tp_dim == 0:
            return weight.rows(*self._output_rows(shard_id, weight.shape[0]))
        size = weight.shape[1] // self.tp_size
        return weight.columns(*(self.shard or (self.tp_rank * size, size)))

    def _output_rows(self, shard_id: str | int | None, rows: int) -> tuple[int, int]:
        """(start, size) of this rank's rows in a checkpoint tensor of `rows` output rows."""
        size = rows // self.tp_size
        return self.tp_rank * size, size

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self._quantized(self.quant, x, bias)
        four_bit = self.int4
        if four_bit is None:
            return self._dense(x, bias)
        n = self.rows.decodes if self.rows.decodes <= four_bit.max_rows else 0
        if n and n == x.shape[0]:
            return four_bit(x, bias)
        rest = x[n:]
        if four_bit.amx is not None and self.rows.wide:
            rest = four_bit.wide(rest, bias)
        elif self.packed_only:
            rest = four_bit(rest, bias)
        else:
            rest = self._dense(rest, bias)
        return torch.cat([four_bit(x[:n], bias), rest]) if n else rest

    @property
    def packed_only(self) -> bool:
        """Whether W lives only as the file stores it (no dense copy: every row takes it)."""
        return self.weight.numel() == 0 and self.packed is None

    def _quantized(
        self, quant: QuantRows, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows from W's GGUF blocks, `max_rows` at a time (a row's result is the same at any
        count): all of a float32 step's (faster than MKL's float32 product at any row count
        measured) and of a weight kept only as stored, a bfloat16 step's decodes
        (`rows.decodes`; the rest oneDNN's bfloat16)."""
        every = x.dtype == torch.float32 or self.packed_only
        n = x.shape[0] if every else self.rows.decodes
        if n == x.shape[0]:
            return quant.in_turns(x, bias)
        rest = self._dense(x[n:], bias)
        return torch.cat([quant.in_turns(x[:n], bias), rest]) if n else rest

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, least = x.shape[0], self.rows.dense_min
        if n < least:  # see `RowPaths.dense_min`
            padded = torch.cat([x, x.new_zeros(least - n, x.shape[1])])
            return self.dense_rows(padded, bias)[:n]
        return self.dense_rows(x, bias)

    def dense_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        y = few_rows_product(x, self.weight)
        if y is None:
            return F.linear(x, self.weight, bias)
        return y if bias is None else y.add_(bias)

    def pack_for_cpu(self) -> None:
        """Keep W only in oneDNN's blocked layout (see `pack_cpu_weights`); nothing where W is
        kept only as the file stores it."""
        if self.weight.numel() == 0:
            return
        self.packed = pack_cpu_weight(self.weight)
        self.weight.data = self.weight.data.new_empty(0)  # the packed copy replaces it

    def unpack(self) -> None:
        """W back in its plain layout, read out of the oneDNN copy (an exact reorder), so new
        values can be written into it; `pack_for_cpu` packs it again."""
        if self.packed is not None:
            self.weight.data = self.packed.to_dense()
            self.packed = None

    def attach_quantized(self, weight: Quantized, integer: bool = False) -> bool:
        """Run a step's decode rows (`rows.decodes`) on `weight`, W as the GGUF file stores it
        (`integer`: in the integer mode where its type has one); returns whether a kernel took
        it (see `quantized_kernel`)."""
        if weight.shape != (self.output_size, self.input_size):
            size = [self.output_size, self.input_size]
            raise ValueError(f"quantized weight {weight.shape} for a {size} layer")
        kernel = quantized_kernel(weight, self.weight.dtype, integer)
        if isinstance(kernel, Int4Linear):
            self.int4 = kernel
        else:
            self.quant = kernel
        self.stored = weight if kernel is not None else None
        return kernel is not None

    def detach_quantized(self) -> bool:
        """Drop the quantized weight (the dense one takes new values, dequantized from it first
        where it was the only copy); whether there was one."""
        had = self.int4 is not None or self.quant is not None
        if had and self.packed_only and self.stored is not None:
            self.weight.data = self.stored.dequantize().to(self.weight.dtype)
        self.int4 = self.quant = self.stored = None
        return had


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice, no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up).

    Shard `i` of the checkpoint lands at this rank's slice of output block `i`, so the rank's
    output is [its gate slice, its up slice] and an elementwise op can pair them.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one shard at a time")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded_weight.chunk(self.tp_size, 0)[self.tp_rank]
        default_weight_loader(param.data.narrow(0, offset, size), shard)  # type: ignore[arg-type]

    def local_rows(self, shard_id: str | int | None = None) -> tuple[int, int]:
        if not isinstance(shard_id, int):
            raise ValueError(f"a merged projection's shards are 0..{len(self.output_sizes) - 1}")
        size = self.output_sizes[shard_id] // self.tp_size
        return sum(self.output_sizes[:shard_id]) // self.tp_size, size


class QKVParallelLinear(LinearBase):
    """Q, K and V projections in one matmul, split by attention heads (`head_shard`).

    When there are fewer KV heads than ranks, each KV head is replicated on
    `tp_size // num_kv_heads` ranks, as every rank needs the KV heads its query heads read.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.head_dim = head_dim
        self.heads = head_shard(num_heads, num_kv_heads, tp_size(), tp_rank())
        self.num_heads, self.num_kv_heads = self.heads.q_count, self.heads.kv_count
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp_dim=0)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        offset, size = self.local_rows(shard_id)
        start = self.heads.q_start if shard_id == "q" else self.heads.kv_start
        shard = loaded_weight.narrow(0, start * self.head_dim, size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)  # type: ignore[arg-type]

    def local_rows(self, shard_id: str | int | None = None) -> tuple[int, int]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size
        if shard_id in ("k", "v"):
            return (q_size if shard_id == "k" else q_size + kv_size), kv_size
        raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', not {shard_id!r}")

    def _output_rows(self, shard_id: str | int | None, rows: int) -> tuple[int, int]:
        if shard_id == "q":
            return self.heads.q_start * self.head_dim, self.num_heads * self.head_dim
        return self.heads.kv_start * self.head_dim, self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank computes: query heads
    [q_start, q_start + q_count) and the KV heads [kv_start, kv_start + kv_count) they read."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Split attention heads over `size` ranks, keeping each query head with its KV head.

    With at least as many KV heads as ranks, each rank takes a contiguous run of KV heads (runs
    differ by at most one head, so a size that does not divide the head count still works:
    SmolLM2-135M's 3 KV heads go 2 + 1 over two ranks) and the query heads that read them.
    With fewer, each KV head is replicated on `size // num_kv_heads` ranks that split its
    query heads.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_count = parallel_state.partition(num_kv_heads, size)[rank]
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {size} ranks")
    replicas = size // num_kv_heads
    kv = rank // replicas
    sub_start, sub_count = parallel_state.partition(group, replicas)[rank % replicas]
    return HeadShard(kv * group + sub_start, sub_count, kv, 1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced.

    The bias is added on rank 0 only, so the all-reduce adds it exactly once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """`shard`: this rank's (start, size) of the input features, where they are not an
        equal share (the attention output of an uneven `head_shard`)."""
        local = shard[1] if shard is not None else divide(input_size, tp_size())
        super().__init__(local, output_size, bias, tp_dim=1, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.lora.runs:  # each rank's partial delta, summed with the base product's
            self.lora.add_delta(self.lora_slot, x, y)
        if self.tp_size > 1:
            parallel_state.tp_all_reduce(y)
        return y


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, optionally fused with the residual add.

    `forward(x, residual)` returns (norm(x + residual), x + residual). The decoder keeps the
    residual stream in float32 whatever the model dtype (Hugging Face keeps it in the model
    dtype): 30 layers of bfloat16 adds cost SmolLM2 a third of its logit error against float32
    (mean largest error per position 0.42 -> 0.30), for a [tokens, hidden] add. The normalised
    output is in the weight's dtype, what the next projection reads.
    """

    fused: FusedOps | None = None  # `use_fused_ops`: one C pass on the CPU

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter((hidden_size,), default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:  # one fused kernel, same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        if self.fused is not None:  # the sum made in place in `residual`
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self._norm(x), x

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), x in float32): the first layer's norm, where the residual stream starts."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, None, self.weight, self.eps)
        return self._norm(x), x.float()


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of the last dimension (the merged gate_up output)."""

    fused: FusedOps | None = None  # `use_fused_ops`: one C pass on the CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype in FUSED_DTYPES:
            return self.fused.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
