"""The C decode-attention kernel against plain float32 attention, and its fallback."""

from __future__ import annotations

import pytest
import torch

from triode.gpu import cpu_kernels
from triode.gpu.attention import Attention, AttentionMetadata, DecodeGroup

kernel = cpu_kernels.paged_decode_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler to build the kernel")


def _reference(q, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """Per sequence: gather its tokens, repeat KV heads for their query heads, softmax."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        k = k_cache[tables[s]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[tables[s]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
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
def test_kernel_matches_attention_over_shuffled_blocks(
    seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    # few sequences split by KV head, many take all heads at once; contexts of 1 token, part of
    # a block, and past several 32-token chunks
    g = torch.Generator().manual_seed(seqs)
    num_blocks = 200
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    lens = torch.tensor([[1, 7, 33, 100, 64][i % 5] for i in range(seqs)])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lens, scale)  # type: ignore[misc]
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = _reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_attention_layer_gives_the_same_with_and_without_the_kernel() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    layers = []
    for use_kernel in (False, True):
        attn = Attention(heads, kv_heads, dim, scale=dim**-0.5)
        attn.k_cache, attn.v_cache = torch.zeros(2, 40, bs, kv_heads, dim, dtype=torch.bfloat16)
        attn.paged_kernel = kernel if use_kernel else None
        layers.append(attn)
    torch.manual_seed(1)
    k_hist, v_hist = (torch.randn(40 * bs, kv_heads, dim).bfloat16() for _ in range(2))
    for attn in layers:
        attn.k_cache.view(-1, kv_heads, dim).copy_(k_hist)
        attn.v_cache.view(-1, kv_heads, dim).copy_(v_hist)
    tables, lens = [[3, 9, 1], [20, 5]], [40, 18]  # the decoded tokens land at 39 and 17
    slots = torch.tensor([tables[0][39 // bs] * bs + 39 % bs, tables[1][17 // bs] * bs + 1])
    q = torch.randn(2, heads, dim).bfloat16()
    k, v = torch.randn(2, kv_heads, dim).bfloat16(), torch.randn(2, kv_heads, dim).bfloat16()
    outs = []
    for attn in layers:
        with_mask = attn.paged_kernel is None
        group = DecodeGroup.build(0, tables, lens, bs, torch.device("cpu"), with_mask=with_mask)
        meta = AttentionMetadata(slots, 2, (group,), ())
        outs.append(attn(q, k, v, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-2, rtol=1e-2)


@needs_kernel
def test_shapes_past_what_the_kernel_was_built_for_take_the_torch_path() -> None:
    assert cpu_kernels.paged_decode_attention_for(9, 3, 64) is kernel
    assert cpu_kernels.paged_decode_attention_for(128, 8, 128) is None  # more than 64 heads
    assert cpu_kernels.paged_decode_attention_for(8, 8, 512) is None  # head_dim over 256


def test_without_a_compiler_attention_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_kernels.paged_decode_attention.cache_clear()
    try:
        assert cpu_kernels.paged_decode_attention() is None
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setenv("TRIODE_CPU_KERNELS", "0")
        cpu_kernels.paged_decode_attention.cache_clear()
        assert cpu_kernels.paged_decode_attention() is None
    finally:
        cpu_kernels.paged_decode_attention.cache_clear()
