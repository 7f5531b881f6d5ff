"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) and a mixture of experts as the feed-forward
block of the layers `decoder_sparse_step` picks and `mlp_only_layers` does not name; the others
keep a dense MLP of `intermediate_size`. The top-k routing weights are renormalised only where
`norm_topk_prob` says so."""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import parallel_state
from .llama import LlamaDecoderLayer, LlamaMLP, layer_window, mlp_bias
from .moe import MoeForCausalLM, SparseMoeBlock
from .qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    expert_parts = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        bias = bool(getattr(config, "attention_bias", False))
        attention = Qwen3Attention(config, bias, bias, layer_window(config, index))
        if not sparse_layer(config, index):
            return LlamaDecoderLayer(config, attention, LlamaMLP(config, mlp_bias(config)))
        if config.hidden_act != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        experts = SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
            expert_parallel=parallel_state.expert_parallel_enabled(),
        )
        return LlamaDecoderLayer(config, attention, experts)


def sparse_layer(config: Any, index: int) -> bool:
    """Whether layer `index` has experts, as transformers decides it."""
    if index in (getattr(config, "mlp_only_layers", None) or []) or not config.num_experts:
        return False
    return (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0
