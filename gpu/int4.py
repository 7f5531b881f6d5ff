"""4-bit weight-only projections on the CPU, from a GGUF checkpoint's own quantized weights.

GGUF's Q4_0 and Q4_1 store each weight row in blocks of 32 inputs: a 4-bit code `q` per weight
and, per block, a float16 scale `d` and (Q4_1) a minimum `m`, so w = d * q + m (Q4_0: m = -8 d).
Converting a GGUF file keeps those codes beside the dequantized float32 checkpoint
(`extract_gguf_int4`), checked to dequantize to exactly the float32 tensors. Two kernels read
them, each streaming about a quarter of the bytes that bfloat16 weights take:

- torch's int4 CPU kernel, for a step's decode rows when there are at most `Int4Linear.max_rows`
  of them (`cpu_paths.RowPaths`): a decode over a few sequences is bound by how fast the
  weights stream from memory (measured on SmolLM2's projections, 2 cores: 1 row 3.7 ms against
  12.2 ms for the blocked bfloat16 weights, 8 rows 11.8 against 12.3). It computes in bfloat16 with
  float32 accumulation and takes the scale and the zero point (m + 8 d) in bfloat16: each
  block's two constants round once, where dense bfloat16 weights round every weight.
- `int4_amx.c` on CPUs with AMX, for the other rows (`Int4Linear.wide`): it widens the codes to
  exactly the dense path's bfloat16 weights and multiplies them with AMX tiles, so past torch's
  kernel's few rows it is the dense product with a quarter of the weight bytes (a decode step
  of 32 sequences of SmolLM2 on 2 cores: 39.5 ms against 30.1 ms).

Without either, or for steps with many prompt rows, the dense weights.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from . import cpu_kernels

GROUP = 32  # inputs per block: GGUF's Q4 block and the kernel's group size
# the most decode rows torch's kernel takes: up to 8 without AMX; beside AMX, which is faster
# from 3 rows on (SmolLM2 decode steps, 2 cores: 8 rows 17.3 ms against 23.9, 4 rows 15.6
# against 16.6, 2 rows 15.0 against 14.7), up to 2
INT4_MAX_ROWS = 8
INT4_MAX_ROWS_BESIDE_AMX = 2


class Int4Weight(NamedTuple):
    """A [rows, cols] weight as stored, in blocks of 32 columns:
    w[r, c] = scale[r, c // 32] * code(r, c) + minimum[r, c // 32]."""

    codes: torch.Tensor  # uint8 [rows, cols // 2]: code(r, 2i) low nibble, code(r, 2i + 1) high
    scale: torch.Tensor  # float32 [rows, cols // 32]
    minimum: torch.Tensor  # float32 [rows, cols // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def unpacked_codes(self) -> torch.Tensor:
        """int32 [rows, cols], each in 0..15."""
        low, high = self.codes & 15, self.codes >> 4
        return torch.stack((low, high), dim=-1).view(self.codes.shape[0], -1).to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the same arithmetic (and so the same bits) as gguf's reader."""
        rows, cols = self.shape
        codes = self.unpacked_codes().view(rows, cols // GROUP, GROUP).float()
        return (self.scale[..., None] * codes + self.minimum[..., None]).view(rows, cols)

    def constants_are_float16(self) -> bool:
        """Whether every scale and minimum is a float16 value, as GGUF stores them (Q4_0's
        minimum, -8 times a float16 scale, is one too)."""
        return all(torch.equal(t.half().float(), t) for t in (self.scale, self.minimum))

    def rows(self, start: int, size: int) -> Int4Weight:
        """Rows [start, start + size): a column-parallel rank's output features."""
        return Int4Weight(*(t[start : start + size] for t in self))

    def columns(self, start: int, size: int) -> Int4Weight:
        """Columns [start, start + size), whole blocks only: a row-parallel rank's inputs."""
        if start % GROUP or size % GROUP:
            raise ValueError(f"columns {start}..{start + size} cut a block of {GROUP}")
        codes = self.codes[:, start // 2 : (start + size) // 2]
        blocks = slice(start // GROUP, (start + size) // GROUP)
        return Int4Weight(codes, self.scale[:, blocks], self.minimum[:, blocks])

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Row blocks stacked, as merged projections (q, k, v; gate, up) stack them."""
        return Int4Weight(*(torch.cat(tensors) for tensors in zip(*parts, strict=True)))

    @staticmethod
    def from_blocks(data: np.ndarray, with_minimum: bool) -> Int4Weight:
        """GGUF Q4 rows -> Int4Weight. A Q4_1 block is d (f16), m (f16) and 16 bytes holding codes
        0..15 in the low nibbles and 16..31 in the high ones; Q4_0 has no m and means m = -8 d."""
        rows = data.shape[0]
        size = 20 if with_minimum else 18
        blocks = data.reshape(rows, -1, size)
        scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        if with_minimum:
            minimum = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        else:
            minimum = -8 * scale
        packed = blocks[..., size - 16 :]
        codes = np.concatenate((packed & 15, packed >> 4), axis=-1).reshape(rows, -1)  # in order
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return Int4Weight(
            torch.from_numpy(np.ascontiguousarray(pairs, dtype=np.uint8)),
            torch.from_numpy(np.ascontiguousarray(scale)),
            torch.from_numpy(np.ascontiguousarray(minimum)),
        )


def torch_kernel_available(dtype: torch.dtype) -> bool:
    """Whether torch's 4-bit CPU kernel takes rows of `dtype` (bfloat16 only)."""
    return dtype == torch.bfloat16 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def kernel_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel here runs weights as a GGUF file stores them for rows of `dtype`:
    `quant_matmul.c` for float32 and bfloat16 where the CPU kernels are built, torch's 4-bit
    kernel for bfloat16."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return cpu_kernels.quant_matmul() is not None or torch_kernel_available(dtype)


class Int4Linear:
    """y = x W^T from W's 4-bit codes; x is bfloat16 [rows, cols].

    A call runs torch's int4 CPU kernel, which reads the codes and multiplies in one pass: the
    fastest for a step's few decode rows (`max_rows`). `wide` runs `int4_amx.c` where the CPU
    has AMX (and W has whole blocks of 16 outputs, with float16 constants; else `amx` is None):
    each block of weights widened once to the dense path's bfloat16 values for all the rows, so
    any number of rows, and a row's result is the same at every row count.
    """

    def __init__(self, weight: Int4Weight) -> None:
        self.shape = rows, cols = weight.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.unpacked_codes(), 1)
        # the kernel dequantizes (code - 8) * scale + zero per group: zero = minimum + 8 * scale;
        # [cols // 32, rows, 2] is the layout it reads
        zero = weight.minimum + 8 * weight.scale
        self.scales_and_zeros = (
            torch.stack((weight.scale, zero), dim=-1).transpose(0, 1).contiguous().bfloat16()
        )
        self.amx = cpu_kernels.int4_amx_matmul() if rows % 16 == 0 else None
        if self.amx is not None and not weight.constants_are_float16():
            self.amx = None
        if self.amx is not None:
            # per block of 16 outputs and group of 32 inputs: byte [r // 4][l][r % 4] holds
            # the codes of input 2r + l % 2 for outputs l // 2 (low nibble) and 8 + l // 2
            # (high nibble); the group's 16 scales and 16 minimums apart, as float16
            # (`constants_are_float16`)
            blocks = (rows // 16, 16, cols // GROUP)
            codes = weight.unpacked_codes().to(torch.uint8).view(rows // 16, 2, 8, -1, 16, 2)
            # [block, half, n, group, r, p] -> [block, group, r, half, n * 2 + p]
            codes = codes.permute(0, 3, 4, 1, 2, 5).reshape(rows // 16, -1, 16, 2, 16)
            codes = codes[..., 0, :] | codes[..., 1, :] << 4  # [block, group, r, l]
            self.codes = codes.view(rows // 16, -1, 4, 4, 16).transpose(3, 4).contiguous()
            self.scale = weight.scale.view(blocks).transpose(1, 2).half().contiguous()
            self.minimum = weight.minimum.view(blocks).transpose(1, 2).half().contiguous()
        self.max_rows = INT4_MAX_ROWS if self.amx is None else INT4_MAX_ROWS_BESIDE_AMX

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
        return y if bias is None else y + bias

    def wide(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T + bias on AMX; only where `amx` is not None."""
        assert self.amx is not None
        rows, cols = x.shape
        if x.dtype != torch.bfloat16 or cols != self.shape[1] or x.stride(1) != 1:
            raise ValueError(f"x of {x.dtype} {list(x.shape)} for a {list(self.shape)} weight")
        y = x.new_empty(rows, self.shape[0])
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        done = self.amx(
            x.data_ptr(), x.stride(0), rows, cols, self.codes.data_ptr(), self.scale.data_ptr(),
            self.minimum.data_ptr(), None if bias is None else bias.data_ptr(), self.shape[0],
            y.data_ptr(), y.stride(0),
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"the AMX kernel refused a {list(self.shape)} weight")
        return y
