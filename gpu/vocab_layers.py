"""The vocabulary's layers: the embedding and the LM head, split across tensor-parallel ranks by
contiguous vocabulary ranges, each able to run from the GGUF file's own blocks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import layers, parallel_state
from .cpu_paths import few_rows_product, pack_cpu_weight
from .gguf_weight import GgufStack, GgufWeight
from .layers import _parameter, default_weight_loader
from .quant_matmul import Quantized, QuantRows, quantized_kernel


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks by contiguous vocabulary ranges.

    Each rank looks up the ids in its range, zeroes the rest, and an all-reduce assembles the rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        # through the module, where a test pretends to be another rank
        self.tp_rank, self.tp_size = layers.tp_rank(), layers.tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = math.ceil(num_embeddings / self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = _parameter((self.shard_size, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start : self.vocab_end]
        param.data.zero_()  # rows past the vocabulary on the last rank stay zero
        default_weight_loader(param.data[: len(shard)], shard)  # type: ignore[arg-type]

    stored: GgufWeight | None = None  # this rank's rows as the file stores them

    def attach_stored(self, weight: GgufWeight, dtype: torch.dtype) -> None:
        """Look rows up in `weight` (the whole checkpoint tensor as the GGUF file stores it;
        this rank's vocabulary rows of it) whenever the dense weight is not kept: each lookup
        dequantizes only the rows it gathers, in `dtype`."""
        if weight.shape[0] < self.vocab_end:
            raise ValueError(
                f"{weight.shape[0]} embedding rows for a vocabulary of {self.vocab_end}"
            )
        self.stored = weight.rows(self.vocab_start, self.vocab_end - self.vocab_start)
        self.stored_dtype = dtype

    def detach_quantized(self) -> bool:
        """Drop the stored rows, dequantized into the dense weight first where they were the
        only copy (it takes new values); False: an embedding is no projection."""
        if self.weight.numel() == 0 and self.stored is not None:
            rows = self.stored.dequantize(self.stored_dtype)
            self.weight.data = torch.cat(
                [rows, rows.new_zeros(self.shard_size - len(rows), rows.shape[1])]
            )
        self.stored = None
        return False

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.numel() or self.stored is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.stored.shape[0]:
            raise IndexError("token id out of the embedding's range")
        rows = self.stored.gather(flat, self.stored_dtype)
        return rows.view(*ids.shape, rows.shape[-1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = self._lookup((input_ids - self.vocab_start) * mine) * mine.unsqueeze(-1)
        parallel_state.tp_all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; with tied embeddings its weight is the embedding's parameter."""

    packed: torch.Tensor | None = None
    quant: QuantRows | None = None  # the GGUF file's own blocks of the weight (`quant_matmul`)

    def pack_for_cpu(self) -> None:
        """A oneDNN-blocked copy for the projection; the plain weight stays for the embedding
        it is tied to. Nothing where the file's blocks are the only copy."""
        if self.weight.numel() == 0:
            return
        self.packed = pack_cpu_weight(self.weight)

    def unpack(self) -> None:
        """Drop the oneDNN copy, so the plain weight (kept) can take new values."""
        self.packed = None

    def attach_quantized(self, weight: Quantized, integer: bool = False) -> bool:
        """Project from `weight`, the whole checkpoint tensor as the GGUF file stores it (this
        rank's vocabulary rows of it; past the vocabulary, zero rows as the dense weight has;
        `integer`: in the integer mode where its type has one); returns whether a kernel took
        it. The embedding keeps reading the dense weight."""
        if isinstance(weight, GgufStack):
            return False  # a whole tensor of the file has one type
        rows = weight.rows(self.vocab_start, self.vocab_end - self.vocab_start)
        if missing := self.shard_size - rows.shape[0]:
            if isinstance(rows, GgufWeight):  # zero bytes: zero scales, zero weights
                zeros = rows.data.new_zeros(missing, rows.data.shape[1])
                rows = GgufWeight(torch.cat([rows.data, zeros]), rows.kind, rows.cols)
            else:
                zeros = type(rows)(*(t.new_zeros(missing, *t.shape[1:]) for t in rows))
                rows = type(rows).cat([rows, zeros])
        kernel = quantized_kernel(rows, self.weight.dtype, integer)
        self.quant = kernel if isinstance(kernel, QuantRows) else None
        self.stored = rows if self.quant is not None else None
        return self.quant is not None

    def detach_quantized(self) -> bool:
        had = self.quant is not None
        if had and self.weight.numel() == 0 and self.stored is not None:
            self.weight.data = self.stored.dequantize().to(self.weight.dtype)
        self.quant = None
        self.stored = None  # type: ignore[assignment]
        return had

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on TP rank 0; None on the other ranks."""
        if self.quant is not None:
            logits = self.quant.in_turns(hidden)
        elif self.packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.packed, None, "none", [], "")
        elif (few := few_rows_product(hidden, self.weight)) is not None:
            logits = few
        elif hidden.device.type == "cpu" and hidden.shape[0] > 1:
            # MKL blocks a vocabulary-wide output badly: 1024-row slices of the weight measured
            # 1.4x faster at 8-64 rows (a single row is memory-bound either way)
            parts = [F.linear(hidden, w) for w in self.weight.split(1024)]
            logits = torch.cat(parts, dim=-1)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            # only the sampling rank (TP rank 0) needs the whole vocabulary: a gather, not an
            # all-gather
            group = layers.tp_group()
            dst = dist.get_global_rank(group, 0) if group is not None else 0
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.gather(logits, parts if self.tp_rank == 0 else None, dst=dst, group=group)
            if self.tp_rank != 0:
                return None
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead projects hidden states: call compute_logits")
