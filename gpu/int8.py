"""8-bit weights from a GGUF checkpoint's own Q8_0 blocks, kept as stored for an int8 kernel.

GGUF's Q8_0 stores each weight row in blocks of 32 inputs: an int8 code `q` per weight and, per
block, a float16 scale `d`, so w = d * q. Converting a GGUF file keeps those codes beside the
dequantized float32 checkpoint (`extract_gguf_q8_0`, in `int4/q8_0.safetensors`), checked to
dequantize to exactly the float32 tensors. The default model's file stores its token embedding,
which is also its tied LM head ([49152, 576]), this way: 34 bytes a block of 32 weights, about
half of what bfloat16 weights take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .cache_paths import INT4_DIR, Q8_FILE
from .int4 import extract_stored, load_stored

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


def load_int8_weights(model_dir: Path) -> dict[str, Int8Weight]:
    """The Q8_0 weights written beside a converted checkpoint, by Hugging Face weight name;
    empty when there are none (a checkpoint that was not a GGUF file, or had no Q8_0 tensors)."""
    return load_stored(model_dir / INT4_DIR / Q8_FILE, Int8Weight)


# --- conversion -------------------------------------------------------------------------------


def extract_gguf_q8_0(
    reader: Any, processor: Any, names: dict[str, str], dense: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The Q8_0 tensors of the GGUF file `reader` reads as safetensors entries
    (`<hf name>.codes`, `.scale`), each kept only if it dequantizes to exactly `dense[hf name]`.

    Names and row order come from the conversion's own mapping, as for the 4-bit projections
    (`int4.extract_gguf_int4`): a tensor that mapping does not move by whole rows stays
    dense-only, as do 3-D tensors (a MoE layer's stacked experts).
    """
    # only a conversion reads GGUF: loading the weights would otherwise pay about 0.3 s more
    # for gguf
    from gguf import GGMLQuantizationType

    return extract_stored(
        reader, processor, names, dense, {GGMLQuantizationType.Q8_0: _from_blocks}
    )


def _from_blocks(data: np.ndarray) -> Int8Weight:
    """GGUF Q8_0 rows (uint8 [rows, cols // 32 * 34]) -> Int8Weight. A block is d (f16) and
    the 32 codes, in order."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _BLOCK_BYTES)
    scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Int8Weight(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)))
