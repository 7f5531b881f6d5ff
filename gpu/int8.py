"""8-bit weights from a GGUF file's own Q8_0 blocks, parsed at load for `quant_matmul.c`.

GGUF's Q8_0 stores each weight row in blocks of 32 inputs: an int8 code `q` per weight and, per
block, a float16 scale `d`, so w = d * q. A Q8_0 weight served from the file
(`gguf_weight.GgufWeight`) is parsed into these codes at load (`Int8Weight.from_blocks`), for
the kernel's own layout. The default model's file stores its token embedding,
which is also its tied LM head ([49152, 576]), this way: 34 bytes a block of 32 weights, about
half of what bfloat16 weights take.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

GROUP = 32  # inputs per block: GGUF's Q8_0 block
_BLOCK_BYTES = 2 + GROUP  # a float16 scale, then the block's int8 codes


class Int8Weight(NamedTuple):
    """A [rows, cols] weight as stored, in blocks of 32 columns:
    w[r, c] = scale[r, c // 32] * codes[r, c]."""

    codes: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, cols // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the same arithmetic (and so the same bits) as gguf's reader."""
        rows, cols = self.shape
        codes = self.codes.view(rows, cols // GROUP, GROUP).float()
        return (self.scale[..., None] * codes).view(rows, cols)

    def scale_is_float16(self) -> bool:
        """Whether every scale is a float16 value, as GGUF stores them."""
        return torch.equal(self.scale.half().float(), self.scale)

    def rows(self, start: int, size: int) -> Int8Weight:
        """Rows [start, start + size): a column-parallel rank's output features (or a
        vocabulary-parallel rank's tokens)."""
        return Int8Weight(*(t[start : start + size] for t in self))

    def columns(self, start: int, size: int) -> Int8Weight:
        """Columns [start, start + size), whole blocks only: a row-parallel rank's inputs."""
        if start % GROUP or size % GROUP:
            raise ValueError(f"columns {start}..{start + size} cut a block of {GROUP}")
        blocks = slice(start // GROUP, (start + size) // GROUP)
        return Int8Weight(self.codes[:, start : start + size], self.scale[:, blocks])

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Row blocks stacked, as merged projections (q, k, v; gate, up) stack them."""
        return Int8Weight(*(torch.cat(tensors) for tensors in zip(*parts, strict=True)))

    @staticmethod
    def from_blocks(data: np.ndarray) -> Int8Weight:
        """GGUF Q8_0 rows (uint8 [rows, cols // 32 * 34]) -> Int8Weight. A block is d (f16) and
        the 32 codes, in order."""
        rows = data.shape[0]
        blocks = data.reshape(rows, -1, _BLOCK_BYTES)
        scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
        return Int8Weight(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)))
