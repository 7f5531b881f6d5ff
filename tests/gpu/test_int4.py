"""4-bit projections from GGUF Q4 blocks, oneDNN-packed bfloat16 projections, and the float32
residual stream: each against plain float32 arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from runner_driver import teacher_forced

from triode.gpu import cpu_kernels, int4
from triode.gpu.cpu_paths import (
    cpu_weight_packing_supported,
    pack_cpu_weights,
    share_row_paths,
)
from triode.gpu.int4 import (
    INT4_MAX_ROWS,
    INT4_MAX_ROWS_BESIDE_AMX,
    Int4Linear,
    Int4Weight,
)
from triode.gpu.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from triode.gpu.lora.punica import LoraRuns, ModuleLora
from triode.gpu.model_runner import ModelRunner
from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

needs_kernel = pytest.mark.skipif(
    not int4.kernel_available(torch.bfloat16, torch.device("cpu")),
    reason="this torch has no int4 CPU kernel",
)
needs_amx = pytest.mark.skipif(
    cpu_kernels.int4_amx_matmul() is None, reason="this CPU has no AMX (or no C compiler)"
)


@pytest.mark.parametrize("fmt", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_blocks_dequantize_to_the_same_bits_as_gguf(fmt: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((6, 96)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1))
    blocks = quantize(dense, fmt)
    weight = Int4Weight.from_blocks(blocks, with_minimum=fmt == GGMLQuantizationType.Q4_1)
    assert weight.shape == (6, 96)
    assert weight.unpacked_codes().min() >= 0 and weight.unpacked_codes().max() <= 15
    expected = torch.from_numpy(dequantize(blocks, fmt))
    assert torch.equal(weight.dequantize(), expected)


def _random_weight(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.001
    minimum = -8 * scale + torch.randn(rows, cols // 32, generator=g) * 0.01
    # float16 constants, as GGUF stores them
    return Int4Weight(codes, scale.half().float(), minimum.half().float())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_kernel_computes_x_times_the_dequantized_weight(rows: int) -> None:
    weight = _random_weight(96, 128)
    x = torch.randn(rows, 128).bfloat16()
    expected = x.float() @ weight.dequantize().t()
    got = Int4Linear(weight)(x).float()
    # bfloat16 output, and scale and zero point rounded to bfloat16 once per block
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@needs_amx
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 64, 100, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_kernel_computes_x_times_the_dense_bfloat16_weights(rows: int, with_bias: bool) -> None:
    # 100 and 300 rows: more than one pass of 64, the last one short; 17: a block of one row
    weight = _random_weight(96, 128)
    linear = Int4Linear(weight)
    assert linear.amx is not None
    x = torch.randn(rows, 128).bfloat16()
    bias = torch.randn(96).bfloat16() if with_bias else None
    # the weights as the dense bfloat16 path holds them: the same bits, widened
    dense = weight.dequantize().bfloat16().float()
    expected = x.float() @ dense.t() + (bias.float() if bias is not None else 0)
    got = linear.wide(x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # float32 sums in another order, then one rounding to bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-3)
    rows_apart = torch.cat([x, torch.zeros(rows, 32, dtype=torch.bfloat16)], 1)[:, :128]
    assert torch.equal(linear.wide(rows_apart, bias), got)
    # a row's result does not depend on how many rows came with it
    assert torch.equal(linear.wide(x[-1:], bias), got[-1:])


@needs_amx
def test_amx_widens_to_exactly_the_dense_bfloat16_weights() -> None:
    # x = I: each sum is one weight times 1, so the output is the widened weights themselves
    weight = _random_weight(96, 128)
    widened = Int4Linear(weight).wide(torch.eye(128, dtype=torch.bfloat16), None)
    assert torch.equal(widened.t(), weight.dequantize().bfloat16())


@needs_amx
def test_amx_refuses_a_wrong_input_and_weights_it_cannot_hold() -> None:
    weight = _random_weight(96, 128)
    with pytest.raises(ValueError, match="for a"):
        Int4Linear(weight).wide(torch.randn(3, 64).bfloat16())
    # constants float16 cannot hold exactly: torch's kernel and the dense weights only
    odd = Int4Weight(weight.codes, weight.scale * (1 + 1e-6), weight.minimum)
    assert Int4Linear(odd).amx is None


@needs_kernel
def test_a_linear_with_int4_takes_it_for_the_leading_decode_rows_and_dense_weights_after() -> None:
    layer = ColumnParallelLinear(128, 96, bias=True).bfloat16()
    layer.weight.data.copy_(torch.randn(96, 128) * 0.05)
    layer.bias.data.copy_(torch.randn(96))
    other = _random_weight(96, 128, seed=1)  # not the dense weight: shows which path ran
    layer.int4 = Int4Linear(other)  # what bfloat16 layers take where the CPU has AMX
    rows = share_row_paths(layer)
    wide = layer.int4.amx is not None
    # torch's kernel takes a step's decodes up to 2 beside AMX (faster from 3 on), else up to 8
    limit = layer.int4.max_rows
    assert limit == (INT4_MAX_ROWS_BESIDE_AMX if wide else INT4_MAX_ROWS)
    x = torch.randn(INT4_MAX_ROWS + 1, 128).bfloat16()
    with torch.no_grad():
        four_bit = x.float() @ other.dequantize().t() + layer.bias.float()
        dense = F.linear(x, layer.weight, layer.bias)
        rows.decodes = 2  # a step of 2 decodes and 7 prompt tokens
        y = layer(x)
        torch.testing.assert_close(y[:2].float(), four_bit[:2], rtol=2e-2, atol=3e-2)
        # the other rows: on AMX where the CPU has it (the 4-bit weights), else dense
        rest = layer.int4.wide(x, layer.bias) if wide else dense
        torch.testing.assert_close(y[2:], rest[2:])
        rows.decodes = limit  # a decode-only step
        torch.testing.assert_close(layer(x[:limit]).float(), four_bit[:limit], rtol=2e-2, atol=3e-2)
        for decodes in (0, limit + 1):  # prompt rows only, or more decodes than it takes
            rows.decodes = decodes
            torch.testing.assert_close(layer(x), rest)
        if wide:
            torch.testing.assert_close(rest.float(), four_bit, rtol=2e-2, atol=3e-2)
        rows.wide = False  # a step of many prompt rows: the dense weights past torch's kernel
        torch.testing.assert_close(layer(x), dense)
        rows.decodes = 2
        torch.testing.assert_close(layer(x)[2:], dense[2:])


@needs_kernel
def test_lora_deltas_add_to_the_4_bit_rows_and_the_dense_rows_alike() -> None:
    """A step of 2 decodes (4-bit) and 3 prompt rows (dense): each run of rows gets its
    adapter's delta over whichever base product computed it, the base model's rows none."""
    layer = ColumnParallelLinear(128, 96).bfloat16()
    layer.weight.data.copy_(torch.randn(96, 128) * 0.05)
    layer.int4 = Int4Linear(_random_weight(96, 128, seed=2))
    rows = share_row_paths(layer)
    rows.decodes, rows.wide = 2, False
    g = torch.Generator().manual_seed(3)
    pairs = [
        ModuleLora(
            (torch.randn(128, 8, generator=g) * 0.1).bfloat16(),
            (torch.randn(8, 96, generator=g) * 0.1).bfloat16(),
        )
        for _ in range(2)
    ]
    x = torch.randn(6, 128).bfloat16()
    with torch.no_grad():
        base = layer(x)
        layer.lora = LoraRuns()
        layer.lora_slot = 0
        # rows 0 (a decode) and 3-4 (prompt rows) on adapter 0, row 1 (a decode) on adapter 1;
        # rows 2 and 5 on the base model
        layer.lora.runs = [(0, 1, [pairs[0]]), (1, 2, [pairs[1]]), (3, 5, [pairs[0]])]
        y = layer(x)
    deltas = torch.zeros(6, 96)
    for lo, hi, (pair,) in layer.lora.runs:
        deltas[lo:hi] = (x[lo:hi].float() @ pair.a_t.float()) @ pair.b_t.float()
    torch.testing.assert_close(y.float(), base.float() + deltas, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y[[2, 5]], base[[2, 5]])


def test_int4_weight_of_the_wrong_shape_is_refused() -> None:
    layer = RowParallelLinear(128, 64)
    with pytest.raises(ValueError, match="quantized weight"):
        layer.attach_quantized(_random_weight(96, 128))


@pytest.mark.skipif(
    not cpu_weight_packing_supported(torch.bfloat16), reason="no bfloat16 oneDNN packing here"
)
def test_packed_bfloat16_projections_equal_plain_ones_and_release_the_plain_weight() -> None:
    model = torch.nn.Sequential(ColumnParallelLinear(64, 96, bias=True), RowParallelLinear(96, 64))
    model = model.bfloat16()
    for layer in model:
        layer.weight.data.copy_(torch.randn_like(layer.weight) * 0.1)
    model[0].bias.data.copy_(torch.randn(96))
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        expected = model(x)
        assert pack_cpu_weights(model) == 2
        assert all(layer.weight.numel() == 0 for layer in model)
        torch.testing.assert_close(model(x), expected)


def test_residual_stream_stays_float32_and_the_norm_returns_the_model_dtype() -> None:
    norm = RMSNorm(8).bfloat16()
    norm.weight.data.fill_(1.5)
    x, residual = torch.randn(3, 8).bfloat16(), torch.randn(3, 8)
    out, summed = norm(x, residual)
    assert summed.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(summed, x.float() + residual)
    expected = 1.5 * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


# --- the real default model -------------------------------------------------------------------


def test_default_models_projections_are_its_files_4_bit_blocks_in_transformers_row_order(
    smollm2: Path,
) -> None:
    import json

    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from triode.gpu.cache_paths import default_gguf
    from triode.gpu.gguf_file import packed_weights

    stored = dict(packed_weights(smollm2))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = {name for name in stored if name.split(".")[-2] in projections}
    assert len(names) == 30 * 7
    assert {stored[name].kind for name in names} == {GGMLQuantizationType.Q4_1}
    assert stored["model.embed_tokens.weight"].kind == GGMLQuantizationType.Q8_0
    # Q and K rows un-permuted from llama.cpp's rotary layout as transformers does the values
    config = json.loads((smollm2 / "config.json").read_text())
    processor = LlamaTensorProcessor(config=config)
    tensors = {t.name: t for t in GGUFReader(default_gguf()).tensors}
    for gguf_name, name in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ):
        tensor = tensors[gguf_name]
        values = dequantize(tensor.data, tensor.tensor_type)
        expected = processor.process(weights=values, name=gguf_name).weights
        weight = Int4Weight.from_blocks(stored[name].data.numpy(), with_minimum=True)
        assert torch.equal(weight.dequantize(), torch.from_numpy(np.asarray(expected)))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("copies", [1, 12])  # torch's int4 kernel; AMX's where the CPU has it
def test_int4_bfloat16_model_predicts_like_float32(smollm2: Path, copies: int) -> None:
    from transformers import AutoTokenizer

    text = (
        "The lighthouse keeper climbed the stairs every evening to light the lamp. Ships passed "
        "the rocks safely because of him, and the village thanked him with bread and fish."
    )
    tokens = AutoTokenizer.from_pretrained(smollm2)(text)["input_ids"]
    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    reference = ModelRunner(smollm2, dtype="float32", **options)
    ref_ids, ref_lp = teacher_forced(reference, tokens)
    ours = ModelRunner(smollm2, dtype="bfloat16", quantization="auto", **options)
    assert ours.quantized_projections == 30 * 4 + 1  # qkv, o, gate_up, down; the LM head
    ids, lp = teacher_forced(ours, tokens, copies)

    same = ids[:, 0] == ref_ids[:, 0]
    assert same.float().mean() >= 0.9
    for position in torch.nonzero(~same).flatten().tolist():
        # a different top token only where float32 itself nearly ties with it
        ranked = dict(zip(ref_ids[position].tolist(), ref_lp[position].tolist(), strict=True))
        assert ranked.get(int(ids[position, 0]), -1e9) > ref_lp[position, 0] - 0.5
    # the top token's probability as float32 gives it
    assert (lp[same, 0] - ref_lp[same, 0]).abs().mean() < 0.1


def test_quantization_none_and_models_without_4_bit_weights_run_dense(
    smollm2: Path, tmp_path: Path
) -> None:
    from triode.gpu.tiny_model import build_tiny_model

    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    assert (
        ModelRunner(smollm2, dtype="bfloat16", quantization="none", **options).quantized_projections
        == 0
    )
    tiny = build_tiny_model(tmp_path / "tiny")
    assert ModelRunner(tiny, dtype="bfloat16", **options).quantized_projections == 0


@needs_kernel
def test_a_decode_computes_the_same_whether_or_not_a_prompt_shares_its_step(
    smollm2: Path,
) -> None:
    # the decode row takes the 4-bit path either way, the prompt rows the dense one: seeded
    # sampling does not depend on which requests happened to arrive together
    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    prompt, other = list(range(100, 120)), list(range(300, 330))
    outputs = []
    for company in ([], [other]):
        runner = ModelRunner(smollm2, dtype="bfloat16", **options)
        assert runner.quantized_projections
        new = NewRequestData(prompt, params)
        [first] = runner.execute(
            SchedulerOutput(0, [ScheduledRequest("a", prompt, 0, [0, 1], new=new)])
        ).results
        assert first.token_id is not None
        step = [ScheduledRequest("a", [first.token_id], len(prompt), [0, 1])]
        step += [
            ScheduledRequest("b", p, 0, [2, 3], new=NewRequestData(p, params)) for p in company
        ]
        result = runner.execute(SchedulerOutput(1, step)).results[0]
        assert result.request_id == "a" and result.logprobs is not None
        outputs.append(result.logprobs.logprobs)
    np.testing.assert_array_equal(outputs[1], outputs[0])


def _random_int4(rows: int, cols: int, seed: int) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) + 0.1
    minimum = torch.randn(rows, cols // 32, generator=g)
    return Int4Weight(codes, scale, minimum)


@pytest.mark.parametrize(
    ("build", "shards"),
    [
        (lambda: ColumnParallelLinear(64, 96), {None: (96, 64)}),
        (lambda: RowParallelLinear(128, 48), {None: (48, 128)}),
        (lambda: MergedColumnParallelLinear(64, [96, 96]), {0: (96, 64), 1: (96, 64)}),
        # 6 query and 3 KV heads of 32 over 2 ranks: 4 + 2 and 2 + 1, uneven like SmolLM2's
        (lambda: QKVParallelLinear(64, 32, 6, 3, bias=False), {"q": (192, 64), "k": (96, 64),
                                                              "v": (96, 64)}),
    ],
)  # fmt: skip
def test_a_ranks_quantized_part_is_its_dense_shard(
    monkeypatch: pytest.MonkeyPatch, build: object, shards: dict[object, tuple[int, int]]
) -> None:
    from triode.gpu import layers

    for rank in range(2):
        monkeypatch.setattr(layers, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(layers, "tp_size", lambda: 2)
        layer = build()  # type: ignore[operator]
        parts = []
        for i, (shard_id, shape) in enumerate(shards.items()):
            whole = _random_int4(*shape, seed=i)
            args = () if shard_id is None else (shard_id,)
            layer.weight.weight_loader(layer.weight, whole.dequantize(), *args)
            parts.append(layer.quantized_part(whole, shard_id).dequantize())
        torch.testing.assert_close(torch.cat(parts), layer.weight.data, rtol=0, atol=0)


def test_an_int4_cut_inside_a_block_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from triode.gpu import layers

    monkeypatch.setattr(layers, "tp_rank", lambda: 1)
    monkeypatch.setattr(layers, "tp_size", lambda: 2)
    layer = RowParallelLinear(96, 8)  # 48 inputs a rank: a block and a half
    with pytest.raises(ValueError, match="block"):
        layer.quantized_part(_random_int4(8, 96, seed=0))


@needs_kernel
def test_greedy_steps_pick_from_the_bfloat16_logits_what_the_sampler_picks(
    smollm2: Path,
) -> None:
    # without logprobs a greedy step takes the fused argmax, with them the sampler
    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    runner = ModelRunner(smollm2, dtype="bfloat16", **options)
    prompts = [list(range(100 + 7 * i, 110 + 7 * i)) for i in range(10)]
    outputs = []
    for params in (
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=1),
    ):
        tokens = [list(p) for p in prompts]
        prefix = "g" if params.logprobs is None else "l"
        for step in range(6):
            requests = [
                ScheduledRequest(
                    f"{prefix}{i}",
                    t[-1:] if step else t,
                    len(t) - 1 if step else 0,
                    [2 * i, 2 * i + 1],
                    new=None if step else NewRequestData(t, params),
                )
                for i, t in enumerate(tokens)
            ]
            results = runner.execute(SchedulerOutput(step, requests)).results
            assert all((r.logprobs is None) == (params.logprobs is None) for r in results)
            for t, result in zip(tokens, results, strict=True):
                t.append(result.token_id)
        outputs.append(tokens)
    assert runner._fused is not None
    assert outputs[0] == outputs[1]


@needs_kernel
def test_short_prompt_chunks_attend_through_the_kernel_like_torchs_attention(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triode.gpu import batch

    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)
    prompt = list(range(300, 340))
    outputs = []
    for longest in (batch.KERNEL_MAX_CHUNK, 0):  # the kernel, then torch's attention
        monkeypatch.setattr(batch, "KERNEL_MAX_CHUNK", longest)
        runner = ModelRunner(smollm2, dtype="bfloat16", **options)
        assert runner.paged_kernel
        # a chunk from the start, then one after cached tokens, beside a decode
        first = ScheduledRequest("a", prompt[:25], 0, [0, 1, 2], new=NewRequestData(prompt, params))
        runner.execute(SchedulerOutput(0, [first]))
        other = ScheduledRequest("b", [7], 0, [3], new=NewRequestData([7], params))
        runner.execute(SchedulerOutput(1, [other]))
        rest = ScheduledRequest("a", prompt[25:], 25, [0, 1, 2])
        decode = ScheduledRequest("b", [8], 1, [3])
        results = runner.execute(SchedulerOutput(2, [rest, decode])).results
        outputs.append({r.request_id: r.logprobs for r in results})
    for request_id in ("a", "b"):
        kernel, torch_attention = outputs[0][request_id], outputs[1][request_id]
        assert kernel is not None and torch_attention is not None
        assert kernel.token_ids[0, 0] == torch_attention.token_ids[0, 0]
        # float32 sums in the kernel, bfloat16 steps in torch's: a bfloat16 model's spread
        np.testing.assert_allclose(kernel.logprobs, torch_attention.logprobs, atol=0.15)
