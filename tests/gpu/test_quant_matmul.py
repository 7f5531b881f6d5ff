"""`quant_matmul.c`: a few rows against GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored, checked
against the dense float32 weights they dequantize to, in the layers and in the default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_driver import teacher_forced

from triode.gpu import cpu_kernels
from triode.gpu.cpu_paths import share_row_paths
from triode.gpu.int4 import Int4Weight
from triode.gpu.int8 import Int8Weight
from triode.gpu.layers import ColumnParallelLinear
from triode.gpu.model_runner import ModelRunner
from triode.gpu.quant_matmul import QuantRows, quantized_kernel
from triode.gpu.vocab_layers import ParallelLMHead

pytestmark = pytest.mark.skipif(
    cpu_kernels.quant_matmul() is None, reason="no C compiler: the CPU kernels are not built"
)
MAX_ROWS = 64


def _int4(rows: int, cols: int, seed: int, q4_0: bool = False) -> Int4Weight:
    """Random GGUF-like 4-bit blocks: float16 scales, and minimums float16 (Q4_1) or -8 x the
    scale (Q4_0)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.02 + 1e-3).half().float()
    minimum = -8 * scale if q4_0 else (-torch.rand(rows, cols // 32, generator=g) * 0.1).half()
    return Int4Weight(codes, scale, minimum.float())


def _int8(rows: int, cols: int, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    return Int8Weight(codes, (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float())


def _kernel(weight: Int4Weight | Int8Weight) -> QuantRows:
    if isinstance(weight, Int4Weight):
        kernel = QuantRows.from_int4(weight)
    else:
        kernel = QuantRows.from_int8(weight)
    assert kernel is not None
    return kernel


WEIGHTS = {
    "q4_1": lambda rows, cols: _int4(rows, cols, seed=0),
    "q4_0": lambda rows, cols: _int4(rows, cols, seed=1, q4_0=True),
    "q8_0": lambda rows, cols: _int8(rows, cols, seed=2),
}


@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize("shape", [(96, 128), (100, 64), (40, 288)])  # 100, 40: a part block
def test_each_weight_widens_to_exactly_the_dense_float32_weight(
    fmt: str, shape: tuple[int, int]
) -> None:
    # x = I: every sum is one weight times 1 plus zeros, so the output is the widened weights
    weight = WEIGHTS[fmt](*shape)
    kernel, dense = _kernel(weight), weight.dequantize()
    cols = shape[1]
    for lo in range(0, cols, MAX_ROWS):
        eye = torch.eye(cols)[lo : lo + MAX_ROWS]
        assert torch.equal(kernel(eye), dense[:, lo : lo + MAX_ROWS].t())


@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_rows_are_the_float32_product_and_the_same_at_every_row_count(fmt: str) -> None:
    weight = WEIGHTS[fmt](176, 576)
    kernel, dense = _kernel(weight), weight.dequantize().double()
    x = torch.randn(MAX_ROWS, 576)
    full = kernel(x)
    reference = x.double() @ dense.t()
    # float32 sums of 576 products: a few units in the last place of the largest terms
    scale = (x.double().abs() @ dense.abs().t()).max()
    assert ((full.double() - reference).abs().max() / scale) < 1e-6
    for rows in range(1, MAX_ROWS):  # the register path (few rows) and the tiled one agree
        assert torch.equal(kernel(x[:rows]), full[:rows]), rows
    bias = torch.randn(176)
    assert torch.equal(kernel(x[:3], bias), full[:3] + bias)
    strided = torch.randn(5, 600)[:, 7:583]  # rows apart by their stride
    assert torch.equal(kernel(strided), kernel(strided.contiguous()))


def test_bfloat16_rows_are_widened_and_the_products_rounded_once() -> None:
    weight = _int4(96, 256, seed=3)
    kernel = _kernel(weight)
    x = torch.randn(9, 256).bfloat16()
    y = kernel(x, torch.randn(96))
    assert y.dtype == torch.bfloat16
    bias = torch.randn(96)
    expected = (kernel(x.float(), bias)).bfloat16()  # the float32 product, rounded
    assert torch.equal(kernel(x, bias), expected)


@pytest.mark.skipif(
    not getattr(cpu_kernels.quant_matmul(), "paired", False), reason="this CPU has no AVX512-BF16"
)
@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_paired_codes_give_bfloat16_rows_the_float32_products_rounded_once(
    fmt: str, without_amx: None
) -> None:
    weight = WEIGHTS[fmt](176, 576)  # 176 outputs: the last block a part one
    if isinstance(weight, Int4Weight):
        paired = QuantRows.from_int4(weight, paired=True)
    else:
        paired = QuantRows.from_int8(weight, paired=True)
    assert paired is not None and paired.paired
    assert quantized_kernel(weight, torch.bfloat16).paired  # type: ignore[union-attr]
    assert not quantized_kernel(weight, torch.float32).paired  # type: ignore[union-attr]
    dense = weight.dequantize()
    for lo in range(0, 576, MAX_ROWS):  # x = I: the dense weights, rounded once
        eye = torch.eye(576)[lo : lo + MAX_ROWS].bfloat16()
        assert torch.equal(paired(eye), dense[:, lo : lo + MAX_ROWS].t().bfloat16())
    x, bias = torch.randn(MAX_ROWS, 576).bfloat16(), torch.randn(176)
    full = paired(x, bias)
    # the float32 path's exact products summed in another order, then rounded: at most a
    # bfloat16 unit in the last place apart
    expected = _kernel(weight)(x.float(), bias)
    terms = (x.float().abs() @ dense.abs().t()).max()
    assert ((full.float() - expected).abs() <= expected.abs() * 2**-7 + terms * 1e-6).all()
    for rows in range(1, MAX_ROWS):  # the register path (few rows) and the tiled one agree
        assert torch.equal(paired(x[:rows], bias), full[:rows]), rows
    strided = torch.randn(MAX_ROWS, 600).bfloat16()[:, 7:583]  # the tiled path packs the rows
    assert torch.equal(paired(strided), paired(strided.contiguous()))
    with pytest.raises(ValueError, match="for a"):
        paired(x.float())  # paired codes take bfloat16 rows only


def test_inputs_the_kernel_does_not_take_are_refused() -> None:
    kernel = _kernel(_int4(32, 64, seed=4))
    for bad in (
        torch.randn(0, 64),
        torch.randn(MAX_ROWS + 1, 64),
        torch.randn(2, 96),
        torch.randn(2, 64).half(),
        torch.randn(64, 2).t(),
    ):
        with pytest.raises(ValueError, match="for a"):
            kernel(bad)
    # constants float16 cannot hold were not GGUF's: no kernel, the dense weights
    odd = _int4(32, 64, seed=4)
    assert QuantRows.from_int4(odd._replace(scale=odd.scale * (1 + 1e-6))) is None
    codes = _int8(32, 64, seed=5)
    assert QuantRows.from_int8(codes._replace(scale=codes.scale * (1 + 1e-6))) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projection_runs_its_rows_from_its_blocks_float32_all_bfloat16_the_decodes(
    dtype: torch.dtype, without_amx: None
) -> None:
    layer = ColumnParallelLinear(128, 96, bias=True).to(dtype)
    layer.weight.data.copy_(torch.randn(96, 128) * 0.05)
    layer.bias.data.copy_(torch.randn(96))
    other = _int4(96, 128, seed=6)  # not the dense weight: shows which path ran
    assert layer.attach_quantized(other) and layer.quant is not None and layer.int4 is None
    rows = share_row_paths(layer)
    kernel = _kernel(other)
    x = torch.randn(2 * MAX_ROWS + 3, 128).to(dtype)
    with torch.no_grad():
        dense = torch.nn.functional.linear(x, layer.weight, layer.bias)
        for decodes in (0, 1, 5, MAX_ROWS, 2 * MAX_ROWS + 1):
            rows.decodes = decodes
            y = layer(x)
            # the kernel takes rows in turns of MAX_ROWS: the same rows as one at a time
            n = len(x) if dtype == torch.float32 else decodes
            quantized = [kernel(x[i : min(i + MAX_ROWS, n)], layer.bias)
                         for i in range(0, n, MAX_ROWS)]  # fmt: skip
            if quantized:
                assert torch.equal(y[:n], torch.cat(quantized))
            torch.testing.assert_close(y[n:], dense[n:])
        assert layer.detach_quantized() and layer.quant is None
        rows.decodes = 4
        torch.testing.assert_close(layer(x), dense)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_lm_head_projects_every_row_from_its_vocabulary_part_of_the_q8_0_blocks(
    monkeypatch: pytest.MonkeyPatch, tp_size: int
) -> None:
    from triode.gpu import layers

    vocab, hidden = 301, 64  # over 2 ranks: 151 + 150 and a zero row, as the dense weight has
    whole = _int8(vocab, hidden, seed=7)
    hidden_states = torch.randn(70, hidden)  # more rows than the kernel takes at once
    for rank in range(tp_size):
        monkeypatch.setattr(layers, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(layers, "tp_size", lambda: tp_size)
        head = ParallelLMHead(vocab, hidden)
        head.weight.weight_loader(head.weight, whole.dequantize())
        dense = hidden_states @ head.weight.t()
        if tp_size > 1:  # compute_logits gathers over the group: the rank's part alone here
            monkeypatch.setattr(head, "tp_size", 1)
        assert head.attach_quantized(whole)
        logits = head.compute_logits(hidden_states)
        assert logits is not None and logits.shape == dense[:, :vocab].shape
        torch.testing.assert_close(logits, dense[:, :vocab], rtol=1e-5, atol=1e-5)
        assert head.detach_quantized() and head.quant is None


# --- the real default model -------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_in_float32_predicts_as_its_dense_weights_with_either_head(
    smollm2: Path,
) -> None:
    """Its projections (Q4_1) and head (Q8_0) as stored, against the same weights dequantized
    to float32 and run by torch: only the order of float32 additions differs, so the top tokens
    agree but for near-ties, and so do their logprobs."""
    from transformers import AutoTokenizer

    text = (
        "The lighthouse keeper climbed the stairs every evening to light the lamp. Ships passed "
        "the rocks safely because of him, and the village thanked him with bread and fish."
    )
    tokens = AutoTokenizer.from_pretrained(smollm2)(text)["input_ids"]
    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    dense = ModelRunner(smollm2, dtype="float32", quantization="none", **options)
    assert dense.quantized_projections == 0
    ref_ids, ref_lp = teacher_forced(dense, tokens)
    for quantization, attached in (("auto", 30 * 4 + 1), ("dense-head", 30 * 4)):
        ours = ModelRunner(smollm2, dtype="float32", quantization=quantization, **options)
        assert ours.quantized_projections == attached
        ids, lp = teacher_forced(ours, tokens, copies=3)
        same = ids[:, 0] == ref_ids[:, 0]
        for position in torch.nonzero(~same).flatten().tolist():
            assert (ref_lp[position, 0] - ref_lp[position, 1]).abs() < 1e-3  # a near-tie
        assert (lp[same, 0] - ref_lp[same, 0]).abs().max() < 1e-3
