"""Paged attention in plain torch, so the same code runs on CPU and CUDA.

Each layer owns a K cache and a V cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives in block `block_table[p // block_size]`, slot
`p % block_size`; the runner turns that into a flat slot index per scheduled token.

The flattened batch holds the decodes (one query token each) first, then the prefill chunks.
The decodes come in groups of similar context length (`DecodeGroup`); each group attends in one
`scaled_dot_product_attention` call over its block tables gathered and padded to its longest
context, so one long context pads only its own group, not the whole batch. Each prefill chunk is
one call with a causal mask shifted by the tokens its request had already computed.
Grouped-query attention needs no repeated K/V: the query heads that share a KV head are folded
into the query-length dimension.

A layer with a sliding window of w tokens lets a query at position i see the keys at positions j
with i - w < j <= i (Hugging Face's semantics). Its masks are built by the first layer of a step
that has that window and kept on the chunk or group for the others (a model may mix windowed and
full layers, Gemma 3 several windows); windowed attention gathers only the blocks its windows
reach (a decode's from its window's first block on, a chunk's from its first query's). Layers
without a window read the plain masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One request's multi-token chunk in the flattened batch.

    `mask` is None for a chunk that starts the request (plain causal attention over its own
    K/V); after cached tokens it is [num_tokens, num_computed + num_tokens], True: attend.
    """

    start: int  # first row in the flattened batch
    num_tokens: int
    num_computed: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # [ceil((num_computed + num_tokens) / block_size)] block ids
    mask: torch.Tensor | None
    # window -> (`windowed`'s answer), built by the first layer of the step with that window
    windowed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict, compare=False)

    @classmethod
    def build(
        cls, start: int, num_tokens: int, num_computed: int, block_table: torch.Tensor
    ) -> PrefillChunk:
        mask = None
        if num_computed:
            # query i sits at position num_computed + i and sees keys at positions <= its own
            device = block_table.device
            rows = torch.arange(num_tokens, device=device)[:, None] + num_computed
            mask = torch.arange(num_computed + num_tokens, device=device)[None, :] <= rows
        return cls(start, num_tokens, num_computed, block_table, mask)

    def sees(self, window: int | None, block_size: int) -> tuple[int, torch.Tensor | None]:
        """What a layer with sliding `window` reads: (the first block of the table its keys
        start at, the mask over the keys from there on to the chunk's end; None: plain causal
        attention over the chunk's own K/V). A chunk that starts its request always reads its
        own K/V, from block 0; past a window it takes a banded mask."""
        if window is None or window >= self.num_computed + self.num_tokens:
            return 0, self.mask
        seen = self.windowed.get(window)
        if seen is None:
            # the first query, at num_computed, sees keys from num_computed - window + 1 on
            first_block = max(0, self.num_computed + 1 - window) // block_size
            first_key = first_block * block_size
            device = self.block_table.device
            rows = torch.arange(self.num_tokens, device=device)[:, None] + self.num_computed
            keys = torch.arange(first_key, self.num_computed + self.num_tokens, device=device)
            mask = (keys[None, :] <= rows) & (keys[None, :] > rows - window)
            seen = self.windowed[window] = (first_block, mask)
        return seen


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Consecutive single-token decodes whose contexts span about the same number of blocks."""

    start: int  # first row in the flattened batch
    block_tables: torch.Tensor  # [n, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [n]
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size], True: attend; the kernel
    # reads `context_lens` instead
    # window -> (`sees`'s answer), built by the first layer of the step with that window
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False
    )

    @classmethod
    def build(
        cls,
        start: int,
        tables: list[list[int]],
        context_lens: list[int],
        block_size: int,
        device: torch.device,
        with_mask: bool = True,
    ) -> DecodeGroup:
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        context = torch.tensor(context_lens, device=device)
        mask = None
        if with_mask:
            mask = torch.arange(width * block_size, device=device)[None, :] < context[:, None]
            mask = mask.view(len(tables), 1, 1, width * block_size)
        return cls(start, padded, context, mask)

    def sees(self, window: int | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a layer with sliding `window` (None: the whole context) reads: (block tables,
        mask). Windowed, each row's table starts at the block of its window's first key, the
        tables as wide as a window's blocks at most, and the mask keeps the keys at positions
        context - window .. context - 1."""
        width = self.block_tables.shape[1]
        if window is None or self.mask is None or window >= width * block_size:
            return self.block_tables, self.mask
        seen = self.windowed.get(window)
        if seen is None:
            device = self.block_tables.device
            span = min(width, (window - 1) // block_size + 2)  # the most blocks a window meets
            context = self.context_lens[:, None]
            first = (context - window).clamp(min=0) // block_size
            columns = first + torch.arange(span, device=device)  # [n, span]
            # columns past a row's table read its last block and are masked: no key twice
            tables = self.block_tables.gather(1, columns.clamp(max=width - 1))
            offsets = torch.arange(block_size, device=device)
            keys = (columns[:, :, None] * block_size + offsets).flatten(1)
            mask = (keys < context) & (keys >= context - window)
            seen = self.windowed[window] = (tables, mask[:, None, None, :])
        return seen


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    Built once per step by the model runner and shared by every layer.
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot of every scheduled token
    num_decodes: int  # rows 0 .. num_decodes - 1 are single-token decodes
    decodes: tuple[DecodeGroup, ...]  # covering those rows in order
    prefills: tuple[PrefillChunk, ...]


class Attention(nn.Module):
    """Attention over this layer's paged KV cache; the runner assigns `k_cache`/`v_cache`.

    `window`: the layer's sliding window in tokens (a query at position i sees the keys at
    i - window < j <= i), None where it sees the whole context.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} tokens")
        self.window = window
        self.k_cache = self.v_cache = torch.empty(0)
        # decode attention straight from the paged cache (`cpu_kernels.py`); the runner sets it
        self.paged_kernel: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cached: bool = False,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], written to the cache unless
        `cached` (the caller did). Returns [T, heads * head_dim]."""
        if not cached:
            flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
        parts = []  # in row order: each decode group, then each prefill chunk
        for group in meta.decodes:
            rows = slice(group.start, group.start + group.block_tables.shape[0])
            parts.append(self._decode(q[rows], group))
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            parts.append(self._prefill(q[rows], k[rows], v[rows], chunk))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One query token per request: the kernel reads the cache in place, else the group's
        K/V are gathered once per layer."""
        if self.paged_kernel is not None:
            return self.paged_kernel(
                q,
                self.k_cache,
                self.v_cache,
                group.block_tables,
                group.context_lens,
                self.scale,
                self.window or 0,
            )
        batch = q.shape[0]
        tables, mask = group.sees(self.window, self.k_cache.shape[1])
        keys = self._gather(self.k_cache, tables)
        values = self._gather(self.v_cache, tables)
        if mask is not None:
            # the slots past a row's context (padding, the rest of its last block) hold what
            # another request left: a weight of 0 times its NaN is NaN, so they are zeroed
            unseen = ~mask.view(batch, 1, -1, 1)
            keys.masked_fill_(unseen, 0)
            values.masked_fill_(unseen, 0)
        # [B, kv_heads, group, head_dim]: the group's query heads act as query positions
        q = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(batch, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        n = chunk.num_tokens
        # [kv_heads, group, n, head_dim] against K/V broadcast (stride 0) over the group: GQA
        # without copies, and one [n, context] mask for all heads
        q = q.view(n, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        block_size = self.k_cache.shape[1]
        first_block, mask = chunk.sees(self.window, block_size)
        if chunk.num_computed == 0:
            # nothing cached before the chunk: attend to its own K/V, no gather needed
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            table = chunk.block_table[None, first_block:]
            context = chunk.num_computed + n - first_block * block_size
            keys = self._gather(self.k_cache, table)[0, :, :context]
            values = self._gather(self.v_cache, table)[0, :, :context]
        shape = (self.num_kv_heads, self.group, keys.shape[1], self.head_dim)
        keys, values = keys[:, None].expand(shape), values[:, None].expand(shape)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale
        )
        return out.permute(2, 0, 1, 3).reshape(n, self.num_heads, self.head_dim)

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """[B, max_blocks] block ids -> [B, kv_heads, max_blocks * block_size, head_dim]."""
        # index_select over [num_blocks, block_elems] copies whole blocks; advanced indexing of
        # the 4-d cache goes element by element and is ~5x slower on CPU
        rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.view(-1))
        rows = rows.view(block_tables.shape[0], -1, self.num_kv_heads, self.head_dim)
        return rows.transpose(1, 2)
