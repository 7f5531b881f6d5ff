"""A decode step's decoder layers in one C call (`kernels/decode_stack.c`).

A step whose every row attends like a decode (a request's next token, or a speculating
request's verify rows, each seeing the context up to its own position) runs, per layer, about
ten modules of Python around as many C kernels; for a small model on a CPU the interpreter's
share is a third of the step. `DecodeStack` hands such a step's whole run of layers to one C
function that calls the same kernels in the same order with the same arguments, so every
row's hidden state is the modules' bit for bit (tested), and takes the step only where that
holds:

- the model: Llama-family layers exactly (`LlamaDecoderLayer` with `LlamaAttention` and
  `LlamaMLP`: Llama, SmolLM2, Mistral, Qwen2 with its Q/K/V bias), one tensor-parallel rank,
  the first pipeline stage (the residual stream starts at its first layer);
- the weights and kernels: every projection on `quant_matmul.c` (`LinearBase.quant`), the
  fused CPU operations and the paged decode attention bound;
- the step: decode-like rows only (no prompt chunk), in the paged kernel's one group, at
  most the kernel's 64 rows, no LoRA adapter running.

Anything else takes the modules. What the C side holds are pointers: the plan is rebuilt
whenever a weight, kernel or KV-cache view it points into has changed (`_watched`).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from . import cpu_kernels
from .cpu_kernels import QuantCall
from .models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from .quant_matmul import QuantRows

if TYPE_CHECKING:
    from .attention import AttentionMetadata
    from .rotary import Rope

_P, _I = ctypes.c_void_p, ctypes.c_int64


class StackLayer(ctypes.Structure):
    """`decode_stack.c`'s `stack_layer`."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float), ("qkv", QuantCall), ("o", QuantCall),
        ("gate_up", QuantCall), ("down", QuantCall), ("k_cache", _P), ("v_cache", _P),
        ("window", _I),
    ]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """`decode_stack.c`'s `decode_step`."""

    _fields_ = [
        ("layers", ctypes.POINTER(StackLayer)), ("num_layers", _I), ("rows", _I),
        ("hidden", _I), ("intermediate", _I), ("num_heads", _I), ("num_kv_heads", _I),
        ("head_dim", _I), ("block_size", _I), ("max_blocks", _I), ("scale", ctypes.c_float),
        ("f32", ctypes.c_int32), ("hidden_states", _P), ("residual", _P), ("normed", _P),
        ("qkv", _P), ("attn", _P), ("gate_up", _P), ("act", _P), ("positions", _P),
        ("slots", _P), ("block_tables", _P), ("context_lens", _P), ("cos", _P), ("sin", _P),
    ]  # fmt: skip


# the layers' structures, and each float32 bias copy the C side reads beside its module's bias
Plan = tuple["ctypes.Array[StackLayer]", list[tuple[torch.Tensor, torch.Tensor]]]


class DecodeStack:
    """The decode-only steps of `model` (a `LlamaModel`) in one C call; `run` says per step."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.steps = 0  # steps that took this path
        self._seen: tuple[int, ...] | None = None  # `_watched` when the plan was built
        self._plan: Plan | None = None
        # per layer, the modules whose attributes the plan points into (the modules stay; what
        # they hold changes), looked up once: `_watched` runs every step
        self._parts = [
            (
                layer.self_attn, layer.self_attn.attn, layer.mlp.act_fn,
                (layer.input_layernorm, layer.post_attention_layernorm),
                (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj),
            )
            for layer in model.stage_layers
        ]  # fmt: skip

    @classmethod
    def for_model(cls, model: LlamaModel) -> DecodeStack | None:
        """A stack for `model` where its layers are plain Llama-family ones on one
        tensor-parallel rank, from the first pipeline stage; else None."""
        layers = model.stage_layers
        if not model.first_stage or not layers or cpu_kernels.decode_stack() is None:
            return None
        for layer in layers:
            if (
                type(layer) is not LlamaDecoderLayer
                or type(layer.self_attn) is not LlamaAttention
                or type(layer.mlp) is not LlamaMLP
                or layer.self_attn.qkv_proj.tp_size != 1
            ):
                return None
        return cls(model)

    def run(
        self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers over `hidden` (the step's embeddings, overwritten): (the last layer's
        output, the float32 residual stream), or None where this step takes the modules."""
        rows = hidden.shape[0]
        first = self.model.stage_layers[0]
        kernel = cpu_kernels.quant_matmul()
        if (
            meta.prefills
            or meta.num_decodes != rows
            or len(meta.decodes) != 1  # with the paged kernel: one group of every row
            or kernel is None
            or not 1 <= rows <= kernel.max_rows
            or hidden.dtype not in cpu_kernels.FUSED_DTYPES
            or hidden.dtype != first.input_layernorm.weight.dtype
            or first.self_attn.qkv_proj.lora.runs
            or not hidden.is_contiguous()
            or not all(
                t.dtype == torch.float32 and t.is_contiguous()
                for t in (rope.cos_table, rope.sin_table)
            )
        ):
            return None
        plan = self._current_plan()
        if plan is None:
            return None
        table, biases = plan
        for copy, bias in biases:  # a weight update may have written new values in place
            copy.copy_(bias)
        attn = first.self_attn
        down = first.mlp.down_proj
        dtype = hidden.dtype
        width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
        residual = torch.empty(rows, hidden.shape[1], dtype=torch.float32)
        scratch = [
            hidden.new_empty(rows, size)
            for size in (hidden.shape[1], width, attn.q_size, 2 * down.input_size,
                         down.input_size)
        ]  # fmt: skip
        (group,) = meta.decodes
        tables = group.block_tables.to(torch.int64).contiguous()
        lens = group.context_lens.to(torch.int64).contiguous()
        positions = rope.positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = DecodeStep(
            layers=table, num_layers=len(table), rows=rows, hidden=hidden.shape[1],
            intermediate=down.input_size, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            block_size=attn.attn.k_cache.shape[1], max_blocks=tables.shape[1],
            scale=attn.attn.scale, f32=dtype == torch.float32, hidden_states=hidden.data_ptr(),
            residual=residual.data_ptr(), positions=positions.data_ptr(),
            slots=slots.data_ptr(), block_tables=tables.data_ptr(),
            context_lens=lens.data_ptr(), cos=rope.cos_table.data_ptr(),
            sin=rope.sin_table.data_ptr(),
        )  # fmt: skip
        step.normed, step.qkv, step.attn, step.gate_up, step.act = (t.data_ptr() for t in scratch)
        if cpu_kernels.decode_stack()(ctypes.byref(step)) != 0:  # type: ignore[misc]
            raise RuntimeError(f"the decode stack refused {rows} rows")
        self.steps += 1
        return hidden, residual

    def _watched(self) -> tuple[int, ...]:
        """What the plan points into: every layer's kernels, caches and norm weights (their
        identities and addresses). A weight update, a sleep or a new KV cache changes it."""
        seen: list[int] = []
        for attn, inner, act, norms, projections in self._parts:
            for module in projections:
                seen += (id(module.quant), id(module.bias))
            seen += (
                id(attn.fused), id(inner.paged_kernel), id(act.fused),
                inner.k_cache.data_ptr(), inner.v_cache.data_ptr(),
            )  # fmt: skip
            for norm in norms:
                seen += (id(norm.fused), norm.weight.data_ptr())
        return tuple(seen)

    def _current_plan(self) -> Plan | None:
        seen = self._watched()
        if seen != self._seen:
            self._plan, self._seen = self._build(), seen
        return self._plan

    def _build(self) -> Plan | None:
        """Each layer's structure, and the float32 copies of the biases it points into beside
        their modules' biases; None where a layer cannot take this path."""
        layers = self.model.stage_layers
        table = (StackLayer * len(layers))()
        biases: list[tuple[torch.Tensor, torch.Tensor]] = []
        for entry, layer in zip(table, layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (
                attn.fused is None
                or attn.attn.paged_kernel is None
                or mlp.act_fn.fused is None
                or any(norm.fused is None for norm in norms)
                or not attn.attn.k_cache.numel()
                or not attn.attn.k_cache.is_contiguous()
                or not attn.attn.v_cache.is_contiguous()
                or attn.head_dim % 2
                or attn.head_dim > 512  # `fused_ops.c`'s rotary embedding
            ):
                return None
            for name, module in (
                ("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                ("down", mlp.down_proj),
            ):  # fmt: skip
                quant = module.quant
                if not isinstance(quant, QuantRows):
                    return None
                call = quant.weight_call()
                call.bf16 = norms[0].weight.dtype == torch.bfloat16
                if module.bias is not None:
                    copy = torch.empty(module.bias.shape, dtype=torch.float32)
                    biases.append((copy, module.bias))
                    call.bias = copy.data_ptr()
                setattr(entry, name, call)
            entry.input_norm, entry.post_norm = (n.weight.data_ptr() for n in norms)
            entry.input_eps, entry.post_eps = (n.eps for n in norms)
            entry.k_cache = attn.attn.k_cache.data_ptr()
            entry.v_cache = attn.attn.v_cache.data_ptr()
            entry.window = attn.attn.window or 0
        return table, biases
