"""Rotary position embedding: the cos and sin tables, their scalings (linear, Llama 3), and the
rotation that the torch path applies; the fused CPU kernel (`cpu_kernels.FusedOps.rope_cache`)
reads the same tables."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout), cos/sin cached for every position.

    `scaling` is the Hugging Face `rope_scaling` / `rope_parameters` dict: rope types default,
    linear and llama3 are supported; anything else is refused rather than silently wrong.
    The model looks cos/sin up once per step (`lookup`) and every layer applies them to its
    queries and keys together (`apply`), so a step pays for one gather, not one per layer.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling or {})
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: fold the sign into the table
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), -1), persistent=False)

    def step(self, positions: torch.Tensor, dtype: torch.dtype, look_up: bool = True) -> Rope:
        """What every layer of a step reads: `positions` [T], the tables, and (`look_up`) cos
        and sin looked up for them (`lookup`); the fused kernel reads the tables itself."""
        looked_up = self.lookup(positions, dtype) if look_up else None
        return Rope(positions, self.cos, self.sin, looked_up)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over
        heads, in the activations' dtype as Hugging Face applies them."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, rope: tuple[torch.Tensor, ...] | Rope) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (queries and keys stacked on the heads axis)."""
        if isinstance(rope, Rope):
            assert rope.looked_up is not None, "a step for the fused kernel"
            rope = rope.looked_up
        cos, sin = rope
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T]."""
        rope = self.lookup(positions, q.dtype)
        return self.apply(q, rope), self.apply(k, rope)


class Rope(NamedTuple):
    """One step's rotary embedding, for every layer (`RotaryEmbedding.step`)."""

    positions: torch.Tensor  # [T]
    cos_table: torch.Tensor  # float32 [max_position, head_dim]
    sin_table: torch.Tensor  # float32, the first half negated
    looked_up: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [T, 1, head_dim] in the
    # activations' dtype; None where only the fused kernel reads them


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    kept, the band between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
