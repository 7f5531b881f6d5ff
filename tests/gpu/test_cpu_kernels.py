"""The C kernels (decode attention, the fused ops) against plain torch, and their fallback."""

from __future__ import annotations

import math

import pytest
import torch

from triode.gpu import cpu_kernels
from triode.gpu.attention import Attention, AttentionMetadata, DecodeGroup

kernel = cpu_kernels.paged_decode_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler to build the kernel")
both_dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])

# bfloat16 rounds its output once; float32 sums in another order than torch, libm's expf
CLOSE = {torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}, torch.float32: {"atol": 2e-6, "rtol": 1e-5}}


def _reference(q, k_cache, v_cache, tables, lens, scale, window=0):  # type: ignore[no-untyped-def]
    """Per sequence: gather its tokens (the last `window` of them, 0: all), repeat KV heads for
    their query heads, softmax."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        first = max(0, n - window) if window else 0
        k = k_cache[tables[s]].flatten(0, 1)[first:n].float()
        v = v_cache[tables[s]].flatten(0, 1)[first:n].float()
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,thd->ht", q[s].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize(
    ("seqs", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (3, 9, 3, 64, 16),
        (12, 9, 3, 64, 16),
        (2, 4, 4, 128, 8),
        (9, 8, 1, 32, 16),  # a head size the vector path does not take
        (4, 12, 1, 64, 16),  # nor 12 query heads to a KV head
        (6, 32, 4, 128, 32),
        (5, 2, 2, 64, 5),  # blocks that tiles of 16 tokens straddle
    ],
)
@both_dtypes
def test_kernel_matches_attention_over_shuffled_blocks(
    seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    # few sequences split by KV head, many take all heads at once; contexts of 1 token, part of
    # a block, past several 32-token chunks, and over several 128-token spans with a part one
    g = torch.Generator().manual_seed(seqs)
    num_blocks = 1200
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([[1, 7, 33, 300, 100, 64][i % 6] for i in range(seqs)])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lens, scale)  # type: ignore[misc]
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, **CLOSE[dtype])


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        (9, 3, 64, 16, 1),  # only the token itself
        (9, 3, 64, 16, 20),  # a window starting mid-block, past whole blocks
        (8, 1, 32, 16, 33),  # the generic path: a window one past its 32-token chunk
        (4, 4, 128, 8, 16),  # a window on a block edge
        (2, 2, 64, 5, 17),  # blocks that tiles of 16 tokens straddle
        (12, 1, 64, 16, 100),  # as long as the longest context: every token
    ],
)
@both_dtypes
def test_kernel_reads_only_the_sliding_window(
    heads: int, kv_heads: int, head_dim: int, block_size: int, window: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(window)
    num_blocks, seqs = 200, 6
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 33, 100, 64, 18][:seqs])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lens, scale, window)  # type: ignore[misc]
    expected = _reference(q, k_cache, v_cache, tables, lens, scale, window)
    torch.testing.assert_close(out.float(), expected, **CLOSE[dtype])
    if window < int(lens.max()):  # the window changes what the long contexts see
        everything = _reference(q, k_cache, v_cache, tables, lens, scale)
        assert not torch.allclose(out.float(), everything, atol=1e-2, rtol=1e-2)


@needs_kernel
@both_dtypes
def test_kernel_never_reads_the_blocks_before_the_window(dtype: torch.dtype) -> None:
    # the tokens before the window hold NaN, in whole blocks and in the window's first block: a
    # read of any of them would show in the output
    heads, kv_heads, head_dim, block_size, window = 4, 2, 64, 16, 20
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(8, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables, lens = torch.tensor([[5, 2, 7, 0]]), torch.tensor([60])  # keys 40..59: blocks 7, 0
    for cache in (k_cache, v_cache):
        cache[5] = cache[2] = float("nan")
        cache[7, :8] = float("nan")  # positions 32..39
    q = torch.randn(1, heads, head_dim, generator=g).to(dtype)
    out = kernel(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)  # type: ignore[misc]
    assert torch.isfinite(out.float()).all()
    expected = _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)
    torch.testing.assert_close(out.float(), expected, **CLOSE[dtype])


@needs_kernel
@pytest.mark.parametrize("window", [None, 13])
@both_dtypes
def test_attention_layer_gives_the_same_with_and_without_the_kernel(
    window: int | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    layers = []
    for use_kernel in (False, True):
        attn = Attention(heads, kv_heads, dim, scale=dim**-0.5, window=window)
        attn.k_cache, attn.v_cache = torch.zeros(2, 40, bs, kv_heads, dim, dtype=dtype)
        attn.paged_kernel = kernel if use_kernel else None
        layers.append(attn)
    torch.manual_seed(1)
    k_hist, v_hist = (torch.randn(40 * bs, kv_heads, dim).to(dtype) for _ in range(2))
    for attn in layers:
        attn.k_cache.view(-1, kv_heads, dim).copy_(k_hist)
        attn.v_cache.view(-1, kv_heads, dim).copy_(v_hist)
    tables, lens = [[3, 9, 1], [20, 5]], [40, 18]  # the decoded tokens land at 39 and 17
    slots = torch.tensor([tables[0][39 // bs] * bs + 39 % bs, tables[1][17 // bs] * bs + 1])
    q = torch.randn(2, heads, dim).to(dtype)
    k, v = torch.randn(2, kv_heads, dim).to(dtype), torch.randn(2, kv_heads, dim).to(dtype)
    outs = []
    for attn in layers:
        with_mask = attn.paged_kernel is None
        group = DecodeGroup.build(0, tables, lens, bs, torch.device("cpu"), with_mask=with_mask)
        meta = AttentionMetadata(slots, 2, (group,), ())
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], **CLOSE[dtype])


@needs_kernel
def test_kernel_refuses_queries_of_another_dtype_than_the_cache() -> None:
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="queries against"):
        kernel(torch.zeros(1, 1, 64), cache, cache, tables, lens, 0.125)  # type: ignore[misc]
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        half = cache.half()
        kernel(half[0, :1], half, half, tables, lens, 0.125)  # type: ignore[misc]


@needs_kernel
def test_shapes_past_what_the_kernel_was_built_for_take_the_torch_path() -> None:
    # the kernel as built now: a test that clears the build cache may have run before
    assert cpu_kernels.paged_decode_attention_for(9, 3, 64) is cpu_kernels.paged_decode_attention()
    assert cpu_kernels.paged_decode_attention_for(128, 8, 128) is None  # more than 64 heads
    assert cpu_kernels.paged_decode_attention_for(8, 8, 512) is None  # head_dim over 256


def _clear() -> None:
    for cached in (cpu_kernels._library, cpu_kernels.paged_decode_attention, cpu_kernels.fused_ops):
        cached.cache_clear()


def test_without_a_compiler_the_kernels_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    _clear()
    try:
        assert cpu_kernels.paged_decode_attention() is None
        assert cpu_kernels.fused_ops() is None
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setenv("TRIODE_CPU_KERNELS", "0")
        _clear()
        assert cpu_kernels.paged_decode_attention() is None
        assert cpu_kernels.fused_ops() is None
    finally:
        _clear()


ops = cpu_kernels.fused_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="no C compiler to build the kernels")


def _within_a_step(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bfloat16: one rounding apart at most, the fused ops round once where torch rounds per
    op; float32: the same operations, summed in another order."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1.6e-2)
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=2e-6)


@needs_ops
@pytest.mark.parametrize("rows", [1, 3, 64])
@both_dtypes
def test_fused_norm_adds_the_residual_in_place_and_normalises_like_torch(
    rows: int, dtype: torch.dtype
) -> None:
    from triode.gpu.layers import RMSNorm

    torch.manual_seed(rows)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576).to(dtype)
    x = torch.randn(rows, 576).to(dtype)
    residual = torch.randn(rows, 576)
    expected_out, expected_sum = norm(x, residual.clone())
    start_out, start_residual = norm.start(x)
    norm.fused = ops
    out, summed = norm(x, residual)
    assert summed is residual and out.dtype == dtype
    torch.testing.assert_close(summed, expected_sum)
    _within_a_step(out, expected_out)
    out, residual = norm.start(x)
    torch.testing.assert_close(residual, start_residual)
    _within_a_step(out, start_out)


@needs_ops
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128), (2, 1, 48)])
@both_dtypes
def test_fused_rope_rotates_like_torch_and_writes_keys_and_values_to_their_slots(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    from triode.gpu.rotary import RotaryEmbedding

    torch.manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    rows = 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 7, 100, 511, 3])
    slots = torch.tensor([12, 0, 33, 7, 40])
    k_cache = torch.zeros(3, 16, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, -1, head_dim)
    expected = RotaryEmbedding.apply(qk, rope.lookup(positions, dtype))
    values = qkv[:, (heads + kv_heads) * head_dim :].clone()
    wide = torch.cat([qkv, torch.zeros(rows, 8, dtype=dtype)], 1)  # rows apart
    fused = wide[:, : qkv.shape[1]]
    assert ops is not None
    ops.rope_cache(fused, heads, kv_heads, positions, rope.cos, rope.sin, k_cache, v_cache, slots)
    _within_a_step(fused[:, : (heads + kv_heads) * head_dim], expected.flatten(1))
    assert torch.equal(fused[:, (heads + kv_heads) * head_dim :], values)
    flat_k, flat_v = k_cache.view(-1, kv_heads * head_dim), v_cache.view(-1, kv_heads * head_dim)
    assert torch.equal(flat_k[slots], fused[:, heads * head_dim : (heads + kv_heads) * head_dim])
    assert torch.equal(flat_v[slots], values)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@needs_ops
@pytest.mark.parametrize("size", [1536, 21])  # whole vectors, and a tail
@both_dtypes
def test_fused_silu_mul_matches_torch(size: int, dtype: torch.dtype) -> None:
    from triode.gpu.layers import SiluAndMul

    torch.manual_seed(size)
    x = (torch.randn(7, 2 * size) * 6).to(dtype)
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp's clamped ends
    act = SiluAndMul()
    expected = act(x)
    act.fused = ops
    _within_a_step(act(x), expected)


@needs_ops
def test_fused_ops_refuse_what_they_cannot_read() -> None:
    assert ops is not None
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ops.silu_mul(torch.randn(2, 8).half())
    with pytest.raises(ValueError, match="norm weight"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        ops.add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(2, 8).bfloat16(),
                         torch.ones(8).bfloat16(), 1e-5)  # fmt: skip
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    table = torch.zeros(10, 64)
    with pytest.raises(ValueError, match="width"):
        ops.rope_cache(torch.zeros(1, 100).bfloat16(), 1, 1, torch.zeros(1), table, table,
                       cache, cache, torch.zeros(1))  # fmt: skip


@needs_ops
@pytest.mark.parametrize("cols", [49152, 100, 37, 5])  # vectors (and a tail), a tail alone
@both_dtypes
def test_fused_argmax_picks_what_torch_max_picks(cols: int, dtype: torch.dtype) -> None:
    assert ops is not None
    torch.manual_seed(cols)
    x = torch.randn(9, cols).to(dtype)
    x[1] = 0.0  # all equal: the first
    x[2, cols // 2 :] = x[2].max() + 1  # equal maxima: the first of them
    x[3] = -math.inf
    x[4, cols - 1] = math.nan  # a NaN is the largest
    x[5, cols // 3] = math.nan
    x[5, cols - 1] = math.nan  # the first NaN
    x[6, 0] = math.inf
    if cols >= 100:  # the first of equals, and the first NaN, in a later lane than the next
        x[7, 50] = x[7, 70] = x[7].max() + 1
        x[8, 40] = x[8, 65] = math.nan
    wide = torch.cat([x, torch.zeros(9, 3, dtype=dtype)], 1)[:, :cols]  # rows apart
    expected = torch.max(x.float(), dim=-1).indices
    assert torch.equal(ops.argmax(x), expected)
    assert torch.equal(ops.argmax(wide), expected)
