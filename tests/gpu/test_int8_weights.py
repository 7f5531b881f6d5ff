"""8-bit weights from GGUF Q8_0 blocks: parsed as stored, cut like dense slices, and the
default model's embedding served from its file exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from triode.gpu.gguf_file import packed_weights
from triode.gpu.int8 import Int8Weight

Q8_0 = GGMLQuantizationType.Q8_0


def _blocks(scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 rows written byte by byte: per block of 32, d as float16, then 32 int8 codes."""
    rows, blocks = scales.shape
    d = scales.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    q = codes.astype(np.int8).view(np.uint8).reshape(rows, blocks, 32)
    return np.concatenate((d, q), axis=-1).reshape(rows, blocks * 34)


def test_hand_made_q8_0_blocks_parse_to_the_codes_and_scales_written() -> None:
    rng = np.random.default_rng(0)
    scales = np.array([[0.5, -0.25, 6e-8], [1024.0, 2.0**-14, 0.0]])  # a subnormal, a zero
    codes = rng.integers(-128, 128, (2, 96))
    codes[0, :3] = [-128, 127, 0]
    weight = Int8Weight.from_blocks(_blocks(scales, codes))
    assert weight.shape == (2, 96)
    assert weight.codes.dtype == torch.int8 and weight.scale.dtype == torch.float32
    assert torch.equal(weight.codes, torch.from_numpy(codes).to(torch.int8))
    assert torch.equal(weight.scale, torch.from_numpy(scales.astype(np.float16)).float())
    assert weight.scale_is_float16()
    expected = weight.scale.repeat_interleave(32, dim=1) * torch.from_numpy(codes).float()
    assert torch.equal(weight.dequantize(), expected)


def test_q8_0_blocks_dequantize_to_the_same_bits_as_gguf() -> None:
    rng = np.random.default_rng(1)
    dense = rng.standard_normal((6, 128)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1))
    blocks = quantize(dense, Q8_0)
    weight = Int8Weight.from_blocks(blocks)
    assert weight.shape == (6, 128)
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(blocks, Q8_0)))


def _random_int8(rows: int, cols: int, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    scale = (torch.rand(rows, cols // 32, generator=g) + 0.1).half().float()
    return Int8Weight(codes, scale)


def test_cuts_dequantize_to_the_same_slices_of_the_dense_weight() -> None:
    weight = _random_int8(10, 128, seed=0)
    dense = weight.dequantize()
    assert torch.equal(weight.rows(3, 4).dequantize(), dense[3:7])
    assert weight.columns(32, 64).shape == (10, 64)
    assert torch.equal(weight.columns(32, 64).dequantize(), dense[:, 32:96])
    assert torch.equal(weight.columns(96, 32).rows(0, 2).dequantize(), dense[:2, 96:])
    parts = [weight.rows(0, 3), weight.rows(3, 7)]
    assert torch.equal(Int8Weight.cat(parts).dequantize(), dense)
    other = _random_int8(5, 128, seed=1)
    stacked = Int8Weight.cat([weight, other])
    assert stacked.shape == (15, 128)
    assert torch.equal(stacked.dequantize(), torch.cat([dense, other.dequantize()]))


@pytest.mark.parametrize(("start", "size"), [(16, 32), (32, 48), (0, 1)])
def test_a_column_cut_inside_a_block_is_refused(start: int, size: int) -> None:
    with pytest.raises(ValueError, match="block"):
        _random_int8(4, 128, seed=0).columns(start, size)


def test_scales_float16_cannot_hold_are_told_apart() -> None:
    weight = _random_int8(4, 64, seed=0)
    assert weight.scale_is_float16()
    assert not Int8Weight(weight.codes, weight.scale * (1 + 1e-6)).scale_is_float16()


# --- the real default model -------------------------------------------------------------------


def test_default_models_embedding_is_served_from_its_files_8_bit_blocks(smollm2: Path) -> None:
    from gguf import GGUFReader

    from triode.gpu.cache_paths import default_gguf

    name = "model.embed_tokens.weight"  # also the tied LM head
    stored = dict(packed_weights(smollm2))[name]
    assert stored.kind == Q8_0 and stored.shape == (49152, 576)
    weight = Int8Weight.from_blocks(stored.data.numpy())
    assert weight.codes.dtype == torch.int8 and weight.scale.dtype == torch.float32
    assert weight.scale.shape == (49152, 576 // 32)
    assert weight.scale_is_float16()
    [tensor] = [t for t in GGUFReader(default_gguf()).tensors if t.name == "token_embd.weight"]
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(stored.dequantize(), expected)
