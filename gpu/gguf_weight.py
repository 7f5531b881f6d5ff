"""A weight as a GGUF file stores it: rows of quantized blocks, read where they lie.

GGUF lays a [rows, cols] tensor out row by row, each row `cols / block_size` blocks of one
type (Q4_K, Q6_K, Q8_0, F16, ...): a block holds its scales and its codes, so any run of rows
and any run of whole blocks in every row is a weight of the same type. `GgufWeight` is such a
run over the bytes it was given, usually a view into a mapped file (`gguf_file`: the GGUF file,
or the rows conversion wrote again in the model's order): a tensor parallel rank's rows or block
columns are views too.

A merged projection (q, k, v; gate, up) is a `GgufStack`: its parts' rows one after the other,
each part where it lies and of its own type (a Q4_K_M file's Q4_K queries beside its Q6_K
values), multiplied into its columns of the output (the integer mode's parts in one call).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import gguf_kernels

# GGML's type ids (gguf.GGMLQuantizationType) of the types repacked at load
Q4_0, Q4_1, Q8_0 = 2, 3, 8


def block_shape(kind: int) -> tuple[int, int]:
    """(weights, bytes) of one block of GGML type `kind`."""
    if kind in gguf_kernels.SUPPORTED:
        return gguf_kernels.block_size(kind), gguf_kernels.block_bytes(kind)
    # a rare type, which gguf knows: gguf is imported only then (a third of a second)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return int(size), int(nbytes)


def type_name(kind: int) -> str:
    """GGML's name of type `kind` ("Q4_K")."""
    # gguf for a message only (a third of a second to import)
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


class GgufWeight(NamedTuple):
    """A [rows, cols] weight: `data` uint8 [rows, cols / block_size * block_bytes], each row's
    bytes contiguous (rows may be apart: a view of whole-block columns), blocks of GGML type
    `kind`."""

    data: torch.Tensor
    kind: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    @staticmethod
    def row_bytes(kind: int, cols: int) -> int:
        """Bytes of one row of `cols` weights; ValueError where they are not whole blocks."""
        size, nbytes = block_shape(kind)
        if cols % size:
            raise ValueError(f"{cols} columns are not whole {type_name(kind)} blocks of {size}")
        return cols // size * nbytes

    @classmethod
    def over(cls, data: torch.Tensor, kind: int, cols: int) -> GgufWeight:
        """The weight of `cols` columns whose rows `data` holds (uint8, [rows, row bytes] or
        flat); ValueError where the bytes are not whole rows of whole blocks."""
        width = cls.row_bytes(kind, cols)
        if data.dtype != torch.uint8 or data.numel() % width:
            raise ValueError(f"{data.numel()} bytes are not rows of {cols} {type_name(kind)}")
        return cls(data.reshape(-1, width), kind, cols)

    def rows(self, start: int, size: int) -> GgufWeight:
        """Rows [start, start + size): a column-parallel rank's outputs, a vocabulary-parallel
        rank's tokens."""
        return GgufWeight(self.data[start : start + size], self.kind, self.cols)

    def columns(self, start: int, size: int) -> GgufWeight:
        """Columns [start, start + size) of every row, whole blocks only (ValueError
        otherwise): a row-parallel rank's inputs."""
        weights, nbytes = block_shape(self.kind)
        if start % weights or size % weights:
            raise ValueError(f"columns {start}..{start + size} cut a block of {weights}")
        first = start // weights * nbytes
        return GgufWeight(self.data[:, first : first + size // weights * nbytes], self.kind, size)

    def reordered(self, order: torch.Tensor) -> GgufWeight:
        """Row i is this weight's row order[i] (a copy)."""
        return GgufWeight(self.data[order], self.kind, self.cols)

    @staticmethod
    def cat(parts: list[GgufWeight]) -> GgufWeight | GgufStack:
        """Parts' rows stacked, as merged projections stack them: a `GgufStack` of the parts
        as they lie (no copy), or the one part."""
        if any(p.cols != parts[0].cols for p in parts):
            raise ValueError("stacked weights must have the same columns")
        return parts[0] if len(parts) == 1 else GgufStack(tuple(parts))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] in `dtype`: gguf's own values in float32 (rounded once to `dtype`)."""
        if gguf_kernels.available() and self.kind in gguf_kernels.SUPPORTED:
            return gguf_kernels.dequantize(self.data, self.kind, self.cols, dtype)
        # gguf's numpy decoders only where no kernel is built or the type is a rare one
        from gguf import dequantize

        values = dequantize(self.data.contiguous().numpy(), self.kind)
        return torch.from_numpy(values.reshape(self.shape)).to(dtype)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup); the caller keeps ids in range."""
        if gguf_kernels.available() and self.kind in gguf_kernels.SUPPORTED:
            return gguf_kernels.gather(self.data, self.kind, self.cols, ids, dtype)
        return self.reordered(ids.to(torch.int64)).dequantize(dtype)


class GgufStack(NamedTuple):
    """Weights whose rows stack into one [rows, cols] weight, each where it lies."""

    parts: tuple[GgufWeight, ...]

    @property
    def kind(self) -> int | None:
        """The parts' type where they share one, else None."""
        kinds = {p.kind for p in self.parts}
        return kinds.pop() if len(kinds) == 1 else None

    def joined(self) -> GgufWeight:
        """The parts as one weight (a copy); ValueError where their types differ."""
        if self.kind is None:
            raise ValueError("parts of different types do not join into one weight")
        return GgufWeight(torch.cat([p.data for p in self.parts]), self.kind, self.parts[0].cols)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


Packed = GgufWeight | GgufStack
