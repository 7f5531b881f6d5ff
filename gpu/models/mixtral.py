"""Mixtral: Mistral's decoder (grouped-query attention, one sliding window for every layer where
the config sets one) with a mixture of experts in place of every layer's MLP, the top-k routing
weights always renormalised."""

from __future__ import annotations

from torch import nn

from .. import parallel_state
from .llama import LlamaAttention, LlamaDecoderLayer, layer_window
from .moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    moe_block = "block_sparse_moe"
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        if config.hidden_act != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        qkv_bias, o_bias = self._attention_bias(config)
        attention = LlamaAttention(config, qkv_bias, o_bias, layer_window(config, index))
        experts = SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            renormalize=True,
            expert_parallel=parallel_state.expert_parallel_enabled(),
        )
        return LlamaDecoderLayer(config, attention, experts)
