"""Qwen3: the Llama decoder with an RMS norm over each query and key head before the rotary
embedding, and no bias on the projections unless `attention_bias` asks for it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import RMSNorm
from .llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    layer_window,
    mlp_bias,
)


class Qwen3Attention(LlamaAttention):
    """Llama's attention with `q_norm` and `k_norm` (one weight of `head_dim` each, shared by
    every head) applied to each head's query and key before they rotate."""

    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, window: int | None = None
    ) -> None:
        super().__init__(config, qkv_bias, o_bias, window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The QKV projection with its query and key heads normalised in place."""
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            -1, self.num_kv_heads, self.head_dim
        )
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        return qkv


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        bias = bool(getattr(config, "attention_bias", False))
        attention = Qwen3Attention(config, bias, bias, layer_window(config, index))
        return LlamaDecoderLayer(config, attention, LlamaMLP(config, mlp_bias(config)))
