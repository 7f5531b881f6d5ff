"""Sliding-window attention in the paged path: the attention layer against a banded reference,
and a tiny Gemma 3 (sliding and global layers) whose prompts cross the window edge in chunks,
after a prefix another request computed, and in decodes past the window, each equal to one
plain run or to transformers."""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path

import pytest
import torch
from runner_driver import Driver, Seq, assert_greedy_as_transformers

from triode.gpu.attention import Attention, AttentionMetadata, DecodeGroup, PrefillChunk
from triode.gpu.loader import transformers_directory
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model

WINDOW = 10
BLOCK = 4  # windows skip whole blocks and start inside others


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None):  # type: ignore[no-untyped-def]
    """Plain GQA attention of queries at positions start.. over keys 0..: a query at i sees the
    keys j with i - window < j <= i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    keys, rows = torch.arange(k.shape[0])[None, :], torch.arange(q.shape[0])[:, None] + start
    allowed = keys <= rows
    if window is not None:
        allowed &= keys > rows - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 1, 5, WINDOW, 40])
def test_windowed_attention_matches_a_banded_reference(window: int | None) -> None:
    """Three decodes (two groups), a chunk after 20 cached tokens and a chunk that starts its
    request, longer than the window, in one forward over shuffled blocks."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    attn = Attention(heads, kv_heads, dim, dim**-0.5, window)
    attn.k_cache, attn.v_cache = torch.zeros(2, 64, BLOCK, kv_heads, dim)
    blocks = torch.randperm(64).tolist()
    lengths, computed = [3, 13, 30, 27, 17], [2, 12, 29, 20, 0]
    tables, used = [], 0
    for n in lengths:
        tables.append(blocks[used : used + -(-n // BLOCK)])
        used += len(tables[-1])
    ks = [torch.randn(n, kv_heads, dim) for n in lengths]
    vs = [torch.randn(n, kv_heads, dim) for n in lengths]
    qs = [torch.randn(n - c, heads, dim) for n, c in zip(lengths, computed, strict=True)]
    flat_k = attn.k_cache.view(-1, kv_heads, dim)
    flat_v = attn.v_cache.view(-1, kv_heads, dim)
    slots = [
        [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        for t, n in zip(tables, lengths, strict=True)
    ]
    for s, k, v, c in zip(slots, ks, vs, computed, strict=True):
        flat_k[s[:c]], flat_v[s[:c]] = k[:c], v[:c]  # the cached prefixes
    cpu = torch.device("cpu")
    chunk_rows = 3 + lengths[3] - computed[3]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([x for s, c in zip(slots, computed, strict=True) for x in s[c:]]),
        num_decodes=3,
        decodes=(
            DecodeGroup.build(0, tables[:2], lengths[:2], BLOCK, cpu),
            DecodeGroup.build(2, tables[2:3], lengths[2:3], BLOCK, cpu),
        ),
        prefills=(
            PrefillChunk.build(3, lengths[3] - computed[3], computed[3], torch.tensor(tables[3])),
            PrefillChunk.build(chunk_rows, lengths[4], 0, torch.tensor(tables[4])),
        ),
    )
    new = [slice(c, None) for c in computed]
    out = attn(
        torch.cat(qs),
        torch.cat([k[s] for k, s in zip(ks, new, strict=True)]),
        torch.cat([v[s] for v, s in zip(vs, new, strict=True)]),
        meta,
    )
    expected = torch.cat(
        [_banded(q, k, v, c, window) for q, k, v, c in zip(qs, ks, vs, computed, strict=True)]
    )
    torch.testing.assert_close(out, expected.reshape(-1, heads * dim))
    if window is not None and window < 30:  # the 30-token decode reads its window's blocks
        read, _ = meta.decodes[1].sees(window, BLOCK)
        assert read.shape[1] == (window - 1) // BLOCK + 2 < len(tables[2])
    if window == WINDOW:  # the chunk after its cached prefix reads from its window's block on
        first_block, mask = meta.prefills[0].sees(WINDOW, BLOCK)
        assert first_block == (computed[3] + 1 - WINDOW) // BLOCK
        assert first_block == 2  # key 11, the first query's first, is in block 2
        rows = lengths[3] - computed[3]
        assert mask is not None and mask.shape == (rows, lengths[3] - first_block * BLOCK)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 3 whose sliding layers see 10 tokens, around a global one."""
    return build_tiny_model(
        tmp_path_factory.mktemp("gemma3"),
        architecture="gemma3",
        num_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
    )


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=1 << 21,
        max_model_len=256,
        num_threads=1,
    )


@functools.cache
def _prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(random.Random(seed).choices(range(3, 250), k=n))


def _run(runner: ModelRunner, prompt: tuple[int, ...], n: int, chunk: int | None = None) -> Seq:
    driver = Driver(runner, shuffle_blocks=True)
    driver.add("r", list(prompt))
    driver.run(n, chunks={"r": chunk} if chunk else None)
    return driver.seqs["r"]


def _assert_same(seq: Seq, reference: Seq) -> None:
    assert seq.output == reference.output
    for ours, theirs in zip(seq.logprobs, reference.logprobs, strict=True):
        assert (ours.token_ids == theirs.token_ids).all()
        torch.testing.assert_close(
            torch.from_numpy(ours.logprobs), torch.from_numpy(theirs.logprobs), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("chunk", [3, WINDOW - 1, WINDOW + 3])
def test_chunked_prefill_across_the_window_edge_equals_one_shot(gemma: Path, chunk: int) -> None:
    runner = _runner(gemma)
    prompt = _prompt(5 * WINDOW + 1)
    _assert_same(_run(runner, prompt, 6, chunk), _run(runner, prompt, 6))


def test_prefix_cached_continuation_equals_a_fresh_run(gemma: Path) -> None:
    """The second request's first 24 tokens (6 blocks) are the first request's, computed by
    it: its prompt's rest attends to the window reaching back into those blocks, from the
    middle of the fourth on."""
    runner = _runner(gemma)
    prefix = 6 * BLOCK
    shared = _prompt(prefix + 5, seed=1)
    driver = Driver(runner)
    driver.add("first", list(shared))
    driver.step()
    prompt = shared[:prefix] + _prompt(7, seed=2)
    driver.add("second", list(prompt))
    second = driver.seqs["second"]
    second.blocks, second.computed = driver.seqs["first"].blocks[: prefix // BLOCK], prefix
    driver.run(6)
    _assert_same(second, _run(runner, prompt, 6))


def test_decodes_past_the_window_in_one_batch_equal_transformers(gemma: Path) -> None:
    """Contexts shorter than the window, across it and several windows long decode together
    (in different decode groups) and each gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    prompts = [_prompt(n, seed=n) for n in (5, 2 * WINDOW + 1, 6 * WINDOW)]
    steps = 12
    driver = Driver(_runner(gemma), shuffle_blocks=True)
    for i, prompt in enumerate(prompts):
        driver.add(str(i), list(prompt))
    driver.run(steps)
    hf = AutoModelForCausalLM.from_pretrained(
        transformers_directory(gemma), dtype=torch.float32
    ).eval()
    for i in range(len(prompts)):
        assert_greedy_as_transformers(driver.seqs[str(i)], hf, steps)
