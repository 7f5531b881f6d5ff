"""The Llama family: Llama, SmolLM2, Mistral and Qwen2 share one decoder.

They differ only in configuration: grouped-query attention, tied embeddings, RoPE scaling, and
Qwen2's bias on the Q/K/V projections. `forward` runs over the flattened batch of every token
scheduled this step ([T] ids and positions in, [T, hidden] out); `compute_logits` projects only the
rows the runner needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import parallel_state
from ..attention import Attention, AttentionMetadata
from ..cpu_kernels import FUSED_DTYPES
from ..layers import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    default_weight_loader,
)
from ..quant_matmul import Quantized
from ..rotary import Rope, RotaryEmbedding
from ..vocab_layers import ParallelLMHead, VocabParallelEmbedding
from .architectures import CheckpointMismatch

if TYPE_CHECKING:
    from ..cpu_kernels import FusedOps
    from ..decode_stack import DecodeStack


class LlamaAttention(nn.Module):
    fused: FusedOps | None = None  # `use_fused_ops`: rotary embedding and cache write in C

    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, window: int | None = None
    ) -> None:
        """`window`: this layer's sliding window (`layer_window`), None where it sees the whole
        context."""
        super().__init__()
        self.head_dim = head_dim(config)
        self.window = window
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        heads = self.qkv_proj.heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            shard=(heads.q_start * self.head_dim, heads.q_count * self.head_dim),
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window
        )

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, q + k + v] for `hidden`: the QKV projection (a family may normalise heads)."""
        return self.qkv_proj(hidden)

    def forward(self, rope: Rope, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.project(hidden)
        qk_size = self.q_size + self.kv_size
        if self.fused is not None and qkv.dtype in FUSED_DTYPES:
            attn = self.attn
            self.fused.rope_cache(
                qkv, self.num_heads, self.num_kv_heads, rope.positions, rope.cos_table,
                rope.sin_table, attn.k_cache, attn.v_cache, meta.slot_mapping,
            )  # fmt: skip
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(-1, self.num_kv_heads, self.head_dim)
            v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
            return self.o_proj(attn(q, k, v, meta, cached=True))
        # queries and keys rotate as one [T, heads + kv_heads, head_dim] tensor: half the ops
        qk = RotaryEmbedding.apply(
            qkv[:, :qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rope
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias)
        if config.hidden_act != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks: the family gives the two blocks (its
    attention, a dense MLP or a mixture of experts)."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer starts the float32 residual stream
            hidden, residual = self.input_layernorm.start(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A place in the layer list that another pipeline stage computes: it has no parameters,
    so this stage holds only its own layers' weights, and checkpoint names keep their index."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this layer belongs to another pipeline stage")


Intermediate = tuple[torch.Tensor, torch.Tensor]  # (hidden, float32 residual) between stages


class LlamaModel(nn.Module):
    """The decoder, or this pipeline stage's contiguous run of its layers (`stage_layers`).

    The first stage embeds, taking given rows (`embeds`: row indices and values in the model's
    dtype) in place of the lookup; a later stage starts from the previous stage's `Intermediate`;
    every stage but the last returns an `Intermediate`, the last the normalised hidden states.
    """

    fused: FusedOps | None = None  # `use_fused_ops`: the layers read the rotary tables
    decode_stack: DecodeStack | None = None  # decode-only steps' layers in one C call

    def __init__(
        self, config: Any, max_position: int, make_layer: Callable[[int], nn.Module]
    ) -> None:
        """`make_layer(i)` builds decoder layer i (the family's: `LlamaForCausalLM.make_layer`)."""
        super().__init__()
        stage = parallel_state.layout()
        self.first_stage, self.last_stage = stage.is_first_stage, stage.is_last_stage
        start, count = parallel_state.partition(config.num_hidden_layers, stage.pp_size)[
            stage.pp_rank
        ]
        self.start_layer, self.end_layer = start, start + count
        if self.first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.make_rotary(config, max_position)
        self.layers = nn.ModuleList(
            make_layer(i) if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        if self.last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config: Any, max_position: int) -> None:
        """The rotary tables that `step_rope` reads: here one, `rotary_emb`."""
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(head_dim(config), max_position, theta, scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `input_ids` (a family may scale them)."""
        return self.embed_tokens(input_ids)

    def step_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every layer of a step takes as its rotary embedding: here one `Rope` (a family
        with a table per layer type gives each layer the means to pick its own)."""
        return self.rotary_emb.step(positions, dtype, look_up=self.fused is None)

    @property
    def stage_layers(self) -> list[LlamaDecoderLayer]:
        return list(self.layers)[self.start_layer : self.end_layer]  # not a new ModuleList

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: Intermediate | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | Intermediate:
        if self.first_stage:
            hidden, residual = self.embed(input_ids), None
            if embeds is not None:  # rows of prompts given as embeddings replace the lookup
                hidden.index_copy_(0, *embeds)
        else:
            if intermediate is None:
                raise ValueError("a later pipeline stage starts from the previous stage's output")
            hidden, residual = intermediate
        rope = self.step_rope(positions, hidden.dtype)  # once per step, for all layers
        stacked = None
        if self.decode_stack is not None and residual is None:
            stacked = self.decode_stack.run(hidden, rope, meta)
        if stacked is not None:
            hidden, residual = stacked
        else:
            for layer in self.stage_layers:
                hidden, residual = layer(rope, hidden, residual, meta)
        if not self.last_stage:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama, SmolLM2 and Mistral (whose sliding window each attention layer applies)."""

    # Hugging Face projection name -> (our merged parameter, its shard)
    packed_modules: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    model_type: type[LlamaModel] = LlamaModel  # the decoder stack; a family may extend it

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        max_position = max_position or config.max_position_embeddings
        self.model = self.model_type(config, max_position, self.make_layer)
        self.lm_head: ParallelLMHead | None = None
        if self.model.last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if config.tie_word_embeddings and self.model.first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` of this family (only this pipeline stage's are built)."""
        config = self.config
        qkv_bias, o_bias = self._attention_bias(config)
        attention = LlamaAttention(config, qkv_bias, o_bias, layer_window(config, index))
        return LlamaDecoderLayer(config, attention, LlamaMLP(config, mlp_bias(config)))

    @staticmethod
    def _attention_bias(config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o): Llama's `attention_bias` covers all four projections."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: Intermediate | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, meta, intermediate, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The last stage's logits, on its TP rank 0 (None on the other TP ranks)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head.compute_logits(hidden)

    def _elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to another pipeline stage."""
        model = self.model
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return not model.start_layer <= index < model.end_layer
        if name.startswith("model.embed_tokens."):
            return not model.first_stage
        if name.startswith("model.norm."):
            return not model.last_stage
        if name.startswith("lm_head."):
            return not model.last_stage
        return False

    def checkpoint_targets(self, name: str) -> list[tuple[str, str | int | None]]:
        """Where checkpoint tensor `name` goes on this rank: (our parameter, its shard of a
        merged projection or None) pairs; none for a tensor this rank skips (another pipeline
        stage's, the tied LM head, rotary tables)."""
        if "rotary_emb.inv_freq" in name:
            return []
        tied = self.config.tie_word_embeddings
        if name == "lm_head.weight" and tied:
            return []
        targets: list[tuple[str, str | int | None]] = []
        # a last stage that does not also embed loads the tied LM head from the embedding
        if name == "model.embed_tokens.weight" and tied and self.lm_head is not None:
            if not self.model.first_stage:
                targets.append(("lm_head.weight", None))
        if self._elsewhere(name):
            return targets
        parts = name.split(".")
        shard: str | int | None = None
        if len(parts) > 1 and parts[-2] in self.packed_modules:
            parts[-2], shard = self.packed_modules[parts[-2]]
        targets.append((".".join(parts), shard))
        return targets

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        partial: bool = False,
        held: Iterable[str] = (),
    ) -> set[str]:
        """Copy Hugging Face checkpoint tensors into our (merged, sharded) parameters; returns
        the names of the parameters written.

        Raises if a tensor has no home or, unless `partial` (new values for some of the
        weights), a parameter stays unloaded, so a wrong mapping fails at start-up instead of
        generating garbage. `held`: parameters whose modules run the GGUF file's blocks alone
        (`hold_stored_weights`), loaded already.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set(held)
        for name, tensor in weights:
            for target, shard_id in self.checkpoint_targets(name):
                param = self._param(params, target)
                if shard_id is not None:
                    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                else:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
        missing = set(params) - loaded
        if missing and not partial:
            raise CheckpointMismatch(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
        return loaded

    def load_quantized_weights(self, weights: Mapping[str, Quantized]) -> int:
        """Give each projection whose every shard `weights` holds (by Hugging Face name) its
        weight as the GGUF file stores it, merged like the dense weights, and the LM head its
        own (a tied one: the embedding's); returns how many projections took them.

        At tensor-parallel sizes above 1 each rank takes its part of every shard, cut as the
        dense weights are; a projection whose cut would split a block stays dense.
        """
        return self.attach_quantized_weights(weights)[0]

    def attach_quantized_weights(
        self, weights: Mapping[str, Quantized], integer: bool = False
    ) -> tuple[int, set[str]]:
        """`load_quantized_weights`, also returning the names of the checkpoint tensors taken
        (`integer`: the types with an integer kernel run in the integer mode)."""
        modules = dict(self.named_modules())
        # our projection -> its shards: (checkpoint name, weight)
        merged: dict[str, dict[str | int, tuple[str, Quantized]]] = {}
        attached = 0
        taken: set[str] = set()
        for name, weight in weights.items():
            if self.lm_head is not None and name == self.lm_head_source():
                if self.lm_head.attach_quantized(weight, integer):
                    attached += 1
                    taken.add(name)
                continue
            parts = name.removesuffix(".weight").split(".")
            shard: str | int = ""
            if parts[-1] in self.packed_modules:
                parts[-1], shard = self.packed_modules[parts[-1]]
            merged.setdefault(".".join(parts), {})[shard] = (name, weight)
        for name, shards in merged.items():
            module = modules.get(name)
            if not isinstance(module, LinearBase):
                continue
            order = self._shard_order(module)
            if set(shards) != set(order):
                continue  # a shard stayed dense: so does the whole projection
            try:
                parts = [module.quantized_part(shards[s][1], s) for s in order]
                whole = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)
            except (ValueError, TypeError):  # a cut inside a block; repacked codes of two kinds
                continue
            if module.attach_quantized(whole, integer):
                attached += 1
                taken |= {source for source, _ in shards.values()}
        return attached, taken

    def lm_head_source(self) -> str:
        """The checkpoint tensor the LM head projects with."""
        tied = self.config.tie_word_embeddings
        return "model.embed_tokens.weight" if tied else "lm_head.weight"

    @staticmethod
    def _shard_order(module: LinearBase) -> list[str | int]:
        """The shards of a merged projection in the order its rows stack."""
        if isinstance(module, QKVParallelLinear):
            return ["q", "k", "v"]
        if isinstance(module, MergedColumnParallelLinear):
            return list(range(len(module.output_sizes)))
        return [""]

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        try:
            return params[name]
        except KeyError:
            raise CheckpointMismatch(
                f"checkpoint tensor {name!r} matches no model parameter"
            ) from None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: always a bias on Q/K/V, never on the output projection."""

    @staticmethod
    def _attention_bias(config: Any) -> tuple[bool, bool]:
        return True, False


def layer_window(config: Any, index: int) -> int | None:
    """Layer `index`'s sliding window in tokens (a query sees itself and the window - 1 keys
    before it), or None where it attends to the whole context: `layer_types` where the config
    lists them (Qwen2/3, Gemma 3), else one `sliding_window` for every layer (Mistral,
    Mixtral) unless `use_sliding_window` turns it off."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return window if types[index] == "sliding_attention" else None
    if window and getattr(config, "use_sliding_window", True):
        return int(window)
    return None


def mlp_bias(config: Any) -> bool:
    return bool(getattr(config, "mlp_bias", False))


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either config layout: transformers >= 5 folds both into
    `rope_parameters`; older configs have `rope_theta` and `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


@contextlib.contextmanager
def parameter_defaults(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Create parameters directly in the target dtype and device (no float32 detour)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)
