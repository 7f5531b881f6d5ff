"""Gemma 3 text (`Gemma3ForCausalLM`): the Llama decoder with Gemma's arithmetic.

Its differences, each as transformers computes it: the embedding scaled by sqrt(hidden_size)
(the factor rounded to the model dtype first); RMS norms that scale by (1 + weight), in float32;
four norms per layer (before and after attention, before and after the MLP, the residual added
after the "post" norms); per-head q/k norms as in Qwen3; a tanh-approximated GELU gating the MLP;
an attention scale of query_pre_attn_scalar ** -0.5; sliding-window layers interleaved with
global ones (`layer_types`), each kind with its own rotary table; and, where the config sets
`final_logit_softcapping`, logits squashed to tanh(logits / cap) * cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata
from ..layers import (
    MergedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    default_weight_loader,
)
from ..rotary import Rope, RotaryEmbedding
from .architectures import UnsupportedArchitecture
from .llama import LlamaForCausalLM, LlamaModel, head_dim, layer_window
from .qwen3 import Qwen3Attention

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """RMS norm scaling by (1 + weight), the product in float32 (Hugging Face's arithmetic).

    The 1 is added to the checkpoint's weight as it loads, so the fused C path of `RMSNorm`
    reads the same weight; in bfloat16 that sum is rounded once (at most 2^-9 of it), where
    Hugging Face keeps it in float32. In float32 the two agree exactly.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _plus_one  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return super()._norm(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(self.weight.dtype)


def _plus_one(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    default_weight_loader(param, loaded_weight.float() + 1.0)


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention with Gemma's (1 + weight) q/k norms and its query scale."""

    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, window: int | None = None
    ) -> None:
        super().__init__(config, qkv_bias, o_bias, window)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn.scale = config.query_pre_attn_scalar**-0.5


class GeluAndMul(nn.Module):
    """gelu(gate) * up (tanh approximation) over the two halves of the merged gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False)
        self.act_fn = GeluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaRopes(NamedTuple):
    """One step's rotary embeddings, a table per layer type; each layer reads its own."""

    sliding: Rope
    full: Rope


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP each between two norms; the residual stream (float32, as in the Llama
    decoder) takes the output of the second."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module, sliding: bool) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.sliding = sliding  # reads the sliding layers' rotary table
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        ropes: GemmaRopes,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output before the residual add, the residual stream so far): the next
        layer's first norm adds the two, as the Llama decoder's does."""
        if residual is None:  # the first layer starts the float32 residual stream
            hidden, residual = self.input_layernorm.start(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        rope = ropes.sliding if self.sliding else ropes.full
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(LlamaModel):
    """The Llama decoder stack with Gemma's scaled embedding, final norm and two rotary tables."""

    def __init__(
        self, config: Any, max_position: int, make_layer: Callable[[int], nn.Module]
    ) -> None:
        super().__init__(config, max_position, make_layer)
        self.embed_scale = config.hidden_size**0.5
        if self.last_stage:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config: Any, max_position: int) -> None:
        """`rotary_emb` for the global layers, `sliding_rotary_emb` for the sliding ones."""
        dim = head_dim(config)
        self.rotary_emb = RotaryEmbedding(dim, max_position, *layer_type_rope(config, FULL))
        self.sliding_rotary_emb = RotaryEmbedding(
            dim, max_position, *layer_type_rope(config, SLIDING)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times sqrt(hidden_size), the factor rounded to the model dtype first as
        Hugging Face rounds it (bfloat16 makes sqrt(3072) = 55.43 55.5)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> GemmaRopes:
        look_up = self.fused is None
        return GemmaRopes(
            self.sliding_rotary_emb.step(positions, dtype, look_up=look_up),
            self.rotary_emb.step(positions, dtype, look_up=look_up),
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_type = Gemma3Model

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        check_config(config)
        super().__init__(config, max_position)

    def make_layer(self, index: int) -> nn.Module:
        config = self.config
        bias = bool(getattr(config, "attention_bias", False))
        attention = Gemma3Attention(config, bias, bias, layer_window(config, index))
        sliding = config.layer_types[index] == SLIDING
        return Gemma3DecoderLayer(config, attention, Gemma3MLP(config), sliding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits, soft-capped where the config says (tanh(logits / cap) * cap)."""
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def check_config(config: Any) -> None:
    """Refuse (UnsupportedArchitecture) a Gemma 3 config that asks for what this
    implementation does not compute, rather than run it wrong."""
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise UnsupportedArchitecture(
            f"Gemma 3 with attn_logit_softcapping={cap}: soft-capped attention scores are not "
            "implemented (Gemma 3 checkpoints leave it null)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture("Gemma 3 with use_bidirectional_attention is not supported")
    activation = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedArchitecture(
            f"Gemma 3 with hidden_activation {activation!r} is not supported"
        )
    types = getattr(config, "layer_types", None)
    if not types or set(types) - {SLIDING, FULL}:
        raise UnsupportedArchitecture(f"Gemma 3 with layer types {types!r} is not supported")


def layer_type_rope(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer type's rotary table: `rope_parameters[layer_type]` in
    transformers >= 5 configs; older ones give the sliding layers `rope_local_base_freq` and the
    global layers `rope_theta` with `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        own = params[layer_type]
        return float(own.get("rope_theta", 10000.0)), own
    if layer_type == SLIDING:
        return float(getattr(config, "rope_local_base_freq", 10000.0)), None
    return float(getattr(config, "rope_theta", 1_000_000.0)), getattr(config, "rope_scaling", None)
