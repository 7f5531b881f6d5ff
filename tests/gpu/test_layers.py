"""Layers: tensor-parallel sharding by weight_loader, RoPE scaling, norms, paged attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from triode.gpu import layers
from triode.gpu.attention import Attention, AttentionMetadata, DecodeGroup, PrefillChunk
from triode.gpu.cpu_paths import cpu_weight_packing_supported
from triode.gpu.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from triode.gpu.rotary import RotaryEmbedding
from triode.gpu.vocab_layers import VocabParallelEmbedding


def _on_ranks(
    monkeypatch: pytest.MonkeyPatch, size: int, build: Callable[[], torch.nn.Module]
) -> list[torch.nn.Module]:
    """Build the layer once per rank of a pretend `size`-way tensor-parallel group."""
    made = []
    for rank in range(size):
        monkeypatch.setattr(layers, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(layers, "tp_size", lambda: size)
        made.append(build())
    return made


def test_column_parallel_shards_concatenate_to_the_full_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight, bias, x = torch.randn(8, 6), torch.randn(8), torch.randn(3, 6)
    parts = []
    for shard in _on_ranks(monkeypatch, 2, lambda: ColumnParallelLinear(6, 8, bias=True)):
        shard.weight.weight_loader(shard.weight, weight)
        shard.bias.weight_loader(shard.bias, bias)
        parts.append(shard(x))
    torch.testing.assert_close(torch.cat(parts, -1), F.linear(x, weight, bias))


def test_row_parallel_partial_sums_add_up_to_the_full_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight, bias, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    ranks = _on_ranks(monkeypatch, 2, lambda: RowParallelLinear(8, 5, bias=True))
    for rank, shard in enumerate(ranks):
        shard.weight.weight_loader(shard.weight, weight)
        shard.bias.weight_loader(shard.bias, bias)
        shard.tp_size = 1  # no process group here: add the partial sums by hand
        total += shard(x[:, rank * 4 : rank * 4 + 4])
    torch.testing.assert_close(total, F.linear(x, weight, bias))


def test_merged_gate_up_shard_holds_each_projections_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    ranks = _on_ranks(monkeypatch, 2, lambda: MergedColumnParallelLinear(4, [6, 6]))
    for rank, shard in enumerate(ranks):
        shard.weight.weight_loader(shard.weight, gate, 0)
        shard.weight.weight_loader(shard.weight, up, 1)
        rows = slice(rank * 3, rank * 3 + 3)
        torch.testing.assert_close(shard.weight.data, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 2, 1), (4, 2, 2), (4, 1, 2)])
def test_qkv_shard_has_its_query_heads_and_the_kv_heads_they_read(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, size: int
) -> None:
    dim = 2
    q, k, v = (torch.randn(n * dim, 3) for n in (heads, kv_heads, kv_heads))
    ranks = _on_ranks(monkeypatch, size, lambda: QKVParallelLinear(3, dim, heads, kv_heads, True))
    for rank, shard in enumerate(ranks):
        for shard_id, w in zip("qkv", (q, k, v), strict=True):
            shard.weight.weight_loader(shard.weight, w, shard_id)
        q_rows = heads // size * dim
        kv_head = rank * kv_heads // size  # replicated when there are fewer kv heads than ranks
        kv_rows = slice(kv_head * dim, (kv_head + shard.num_kv_heads) * dim)
        expected = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv_rows], v[kv_rows]])
        torch.testing.assert_close(shard.weight.data, expected)


def test_vocab_parallel_embedding_shards_cover_the_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = torch.randn(11, 4)
    shards = _on_ranks(monkeypatch, 3, lambda: VocabParallelEmbedding(11, 4))
    for shard in shards:
        shard.weight.weight_loader(shard.weight, table)
    rebuilt = torch.cat([s.weight.data[: s.vocab_end - s.vocab_start] for s in shards])
    torch.testing.assert_close(rebuilt, table)
    assert shards[-1].weight.data[shards[-1].vocab_end - shards[-1].vocab_start :].abs().sum() == 0


def test_rms_norm_with_residual_normalises_the_sum_and_returns_it() -> None:
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.randn(8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_embedding_matches_transformers(scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    extra = {"rope_scaling": scaling} if scaling else {}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, **extra)
    positions = torch.tensor([0, 1, 7, 100, 1000])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos[0], sin[0], 0)
    ours = RotaryEmbedding(16, 2048, 500000.0, scaling)(positions, q, k)
    torch.testing.assert_close(ours[0], hf_q.transpose(0, 1))
    torch.testing.assert_close(ours[1], hf_k.transpose(0, 1))


def test_unsupported_rope_scaling_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="yarn"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int):  # type: ignore[no-untyped-def]
    """Plain causal GQA attention of queries at positions start.. over keys 0..: [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("decode_groups", [[(0, 2)], [(0, 1), (1, 2)]])
def test_paged_attention_over_shuffled_blocks_matches_plain_attention(
    decode_groups: list[tuple[int, int]],
) -> None:
    """A prefill after a cached prefix and two decodes (in one padded group or in two), one
    forward, non-contiguous block tables."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    attn = Attention(heads, kv_heads, dim, scale=dim**-0.5)
    attn.k_cache, attn.v_cache = torch.zeros(2, 32, bs, kv_heads, dim)
    blocks = torch.randperm(32).tolist()
    lengths, computed = [9, 6, 13], [8, 5, 7]  # two decodes, then a 6-token prefill chunk
    tables = [blocks[0:3], blocks[3:5], blocks[5:9]]
    ks = [torch.randn(n, kv_heads, dim) for n in lengths]
    vs = [torch.randn(n, kv_heads, dim) for n in lengths]
    qs = [torch.randn(n - c, heads, dim) for n, c in zip(lengths, computed, strict=True)]
    # the cached prefixes were written by earlier steps
    flat_k, flat_v = attn.k_cache.view(-1, kv_heads, dim), attn.v_cache.view(-1, kv_heads, dim)
    slots = [
        [t[p // bs] * bs + p % bs for p in range(n)] for t, n in zip(tables, lengths, strict=True)
    ]
    for s, k, v, c in zip(slots, ks, vs, computed, strict=True):
        flat_k[s[:c]], flat_v[s[:c]] = k[:c], v[:c]
    cpu = torch.device("cpu")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([x for s, c in zip(slots, computed, strict=True) for x in s[c:]]),
        num_decodes=2,
        decodes=tuple(
            DecodeGroup.build(lo, tables[lo:hi], lengths[lo:hi], bs, cpu)
            for lo, hi in decode_groups
        ),
        prefills=(PrefillChunk.build(2, 6, 7, torch.tensor(tables[2])),),
    )
    new = [slice(c, None) for c in computed]
    out = attn(
        torch.cat(qs),
        torch.cat([k[s] for k, s in zip(ks, new, strict=True)]),
        torch.cat([v[s] for v, s in zip(vs, new, strict=True)]),
        meta,
    )
    expected = torch.cat(
        [_reference_attention(q, k, v, c) for q, k, v, c in zip(qs, ks, vs, computed, strict=True)]
    )
    torch.testing.assert_close(out, expected.reshape(-1, heads * dim))


@pytest.mark.skipif(
    not cpu_weight_packing_supported(torch.bfloat16), reason="no bfloat16 oneDNN packing here"
)
def test_padded_dense_products_give_a_row_the_same_bits_at_any_row_count() -> None:
    # what a prompt's tail computed after a prefix-cache hit needs to match a full prefill
    from triode.gpu.cpu_paths import pack_cpu_weights, share_row_paths

    layer = ColumnParallelLinear(576, 3072).bfloat16()  # SmolLM2's gate_up
    layer.weight.data.copy_(torch.randn(3072, 576) * 0.05)
    pack_cpu_weights(layer)
    rows = share_row_paths(layer)
    rows.dense_min = 64
    x = torch.randn(70, 576).bfloat16()
    with torch.no_grad():
        whole = layer(x)
        for lo, hi in [(67, 70), (60, 70), (0, 1), (32, 35)]:
            assert torch.equal(layer(x[lo:hi]), whole[lo:hi])


@pytest.mark.skipif(
    not cpu_weight_packing_supported(torch.bfloat16), reason="no bfloat16 oneDNN packing here"
)
def test_the_padding_found_by_trying_gives_a_row_the_same_bits_at_any_row_count() -> None:
    from triode.gpu.cpu_paths import pack_cpu_weights, row_invariant_from, share_row_paths

    model = torch.nn.Sequential(
        ColumnParallelLinear(576, 3072).bfloat16(), ColumnParallelLinear(1536, 576).bfloat16()
    )
    for layer in model:
        layer.weight.data.copy_(torch.randn_like(layer.weight) * 0.05)
    pack_cpu_weights(model)
    least = row_invariant_from(model, 64)
    assert 0 <= least <= 64
    rows = share_row_paths(model)
    rows.dense_min = least
    with torch.no_grad():
        for layer in model:
            x = torch.randn(90, layer.input_size).bfloat16()
            whole = layer(x)
            for n in range(1, 90):
                assert torch.equal(layer(x[90 - n :]), whole[90 - n :]), n


def test_a_product_that_changes_below_some_row_count_is_padded_up_to_it() -> None:
    from triode.gpu.cpu_paths import row_invariant_from

    class Doubling(ColumnParallelLinear):
        """A product whose rows do not depend on each other."""

        def dense_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return x[:, : self.output_size] * 2

    class Stepped(Doubling):
        """Its rows come out differently when fewer than 20 come at once."""

        def dense_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = super().dense_rows(x, bias)
            return y + 1e-3 if x.shape[0] < 20 else y

    assert row_invariant_from(torch.nn.Sequential(Doubling(64, 32), Stepped(64, 48)), 64) == 20
    assert row_invariant_from(torch.nn.Sequential(Doubling(64, 32)), 64) == 0
