"""8-bit weights from GGUF Q8_0 blocks: parsed as stored, extracted in the conversion's row
order, cut like dense slices, and the default model's embedding kept exactly."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from triode.gpu.cache_paths import INT4_DIR, Q8_FILE
from triode.gpu.int8 import Int8Weight, _from_blocks, extract_gguf_q8_0, load_int8_weights

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
    weight = _from_blocks(_blocks(scales, codes))
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
    weight = _from_blocks(blocks)
    assert weight.shape == (6, 128)
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(blocks, Q8_0)))


def _reader(*tensors: tuple[str, GGMLQuantizationType, np.ndarray]) -> SimpleNamespace:
    """What the extraction reads of gguf's GGUFReader: each tensor's name, type and data."""
    return SimpleNamespace(
        tensors=[SimpleNamespace(name=n, tensor_type=t, data=d) for n, t, d in tensors]
    )


def test_extraction_keeps_q8_0_tensors_in_the_conversions_row_order() -> None:
    # llama's processor un-permutes Q's rows from llama.cpp's rotary layout: the codes must
    # move with them, or they no longer dequantize to the dense tensor
    processor = LlamaTensorProcessor(config={"num_attention_heads": 2, "num_key_value_heads": 2})
    names = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    }
    rng = np.random.default_rng(2)
    q = quantize(rng.standard_normal((64, 96)).astype(np.float32), Q8_0)
    embedding = quantize(rng.standard_normal((40, 64)).astype(np.float32), Q8_0)
    norm = rng.standard_normal(64).astype(np.float32)
    down = quantize(rng.standard_normal((64, 64)).astype(np.float32), GGMLQuantizationType.Q4_0)
    reader = _reader(
        ("blk.0.attn_q.weight", Q8_0, q),
        ("token_embd.weight", Q8_0, embedding),
        ("blk.0.attn_norm.weight", GGMLQuantizationType.F32, norm),
        ("blk.0.ffn_down.weight", GGMLQuantizationType.Q4_0, down),
    )
    dense = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        moved = processor.process(weights=values, name=tensor.name).weights
        dense[names[tensor.name]] = torch.from_numpy(np.ascontiguousarray(moved))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    as_stored = torch.from_numpy(dequantize(q, Q8_0))
    assert not torch.equal(dense[q_name], as_stored)  # the processor did reorder rows

    out = extract_gguf_q8_0(reader, processor, names, dense)
    assert set(out) == {f"{n}.{part}" for n in (q_name, "model.embed_tokens.weight")
                        for part in ("codes", "scale")}  # fmt: skip
    for name in (q_name, "model.embed_tokens.weight"):
        weight = Int8Weight(out[f"{name}.codes"], out[f"{name}.scale"])
        assert torch.equal(weight.dequantize(), dense[name])

    # codes that do not reproduce the dense tensor stay out
    dense[q_name] = as_stored
    assert set(extract_gguf_q8_0(reader, processor, names, dense)) == {
        "model.embed_tokens.weight.codes",
        "model.embed_tokens.weight.scale",
    }


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


def test_saved_codes_load_back_by_name_and_a_directory_without_them_has_none(
    tmp_path: Path,
) -> None:
    assert load_int8_weights(tmp_path) == {}
    weight = _random_int8(6, 64, seed=3)
    (tmp_path / INT4_DIR).mkdir()
    name = "model.embed_tokens.weight"
    save_file(
        {f"{name}.codes": weight.codes, f"{name}.scale": weight.scale},
        tmp_path / INT4_DIR / Q8_FILE,
    )
    [(loaded_name, loaded)] = load_int8_weights(tmp_path).items()
    assert loaded_name == name
    assert all(torch.equal(a, b) for a, b in zip(loaded, weight, strict=True))


# --- the real default model -------------------------------------------------------------------


def test_converted_default_model_keeps_its_embedding_in_exact_8_bit_codes(smollm2: Path) -> None:
    weights = load_int8_weights(smollm2)
    name = "model.embed_tokens.weight"  # also the tied LM head
    assert set(weights) == {name}
    weight = weights[name]
    assert weight.shape == (49152, 576)
    assert weight.codes.dtype == torch.int8 and weight.scale.dtype == torch.float32
    assert weight.scale.shape == (49152, 576 // 32)
    assert weight.scale_is_float16()
    with safe_open(smollm2 / "model.safetensors", framework="pt") as f:
        dense = f.get_tensor(name)
    assert dense.dtype == torch.float32
    assert torch.equal(weight.dequantize(), dense)
