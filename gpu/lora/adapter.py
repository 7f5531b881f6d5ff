"""One PEFT LoRA adapter made ready for this rank: its files checked in full against the model
and the limits (names, dtypes and shapes from the safetensors header, before any tensor is
read), its scaling folded into B, and this rank's share kept: the pipeline stage's layers, each
pair cut as the base projection is cut (`LinearBase.lora_part`) and merged like our fused
projections (`punica.ModuleLora`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from .files import (
    CONFIG_FILE,
    MAX_HEADER_BYTES,
    PROJECTIONS,
    WEIGHTS_FILE,
    AdapterFiles,
    LoraSettings,
    check_config,
    check_dtype,
    invalid,
    lora_module,
)
from .punica import ModuleLora


@dataclass(frozen=True)
class Adapter:
    """An adapter resident on this rank: `modules` maps our projection names (the merged
    `qkv_proj`, `gate_up_proj`) to this rank's pair."""

    digest: str
    rank: int  # the largest of its modules' ranks
    targets: list[str]  # the projections it targets (Hugging Face names), sorted
    modules: dict[str, ModuleLora]

    @property
    def nbytes(self) -> int:
        return sum(pair.nbytes for pair in self.modules.values())


def read_adapter(
    path: str | Path,
    model: Any,
    *,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    digest: str | None = None,
) -> Adapter:
    """The adapter at `path` checked against `model` (a `LlamaForCausalLM`, its weights loaded
    or asleep) and `max_rank`, this rank's share on `device` in `dtype`. `digest`: what the
    files must hash to. Raises `OperationError("invalid", ...)` naming the problem."""
    config = model.config
    num_layers = config.num_hidden_layers
    shapes = projection_shapes(config, model.model.stage_layers[0].self_attn.head_dim)
    module_names = hf_module_names(num_layers)

    def settings_of(files: AdapterFiles) -> LoraSettings:
        return check_config(files.config(), files.path / CONFIG_FILE, module_names)

    files = AdapterFiles.read(path, max_weights_bytes(shapes, num_layers, max_rank), settings_of)
    if digest is not None and digest != files.digest:
        raise invalid(f"LoRA adapter {str(path)!r} changed on disk (its digest is not {digest})")
    settings = settings_of(files)
    pairs = _checked_pairs(files, settings, shapes, num_layers, max_rank)
    tensors = load_safetensors(files.weights_bytes)
    stage = model.model
    merged: dict[str, list[tuple[str | int | None, torch.Tensor, torch.Tensor]]]
    merged = defaultdict(list)
    for module, (layer, projection) in pairs.items():
        if not stage.start_layer <= layer < stage.end_layer:
            continue  # another pipeline stage's
        key = f"base_model.model.{module}.lora_"
        a = tensors[key + "A.weight"].float()
        b = tensors[key + "B.weight"].float() * settings.scaling(module)
        ours, shard = module, None
        if projection in model.packed_modules:
            merged_name, shard = model.packed_modules[projection]
            ours = module.rsplit(".", 1)[0] + "." + merged_name
        linear = model.get_submodule(ours)
        a, b = linear.lora_part(a, b, shard)
        merged[ours].append((shard, a, b))
    modules = {
        name: _merged_pair(model.get_submodule(name), parts, dtype, device)
        for name, parts in merged.items()
    }
    ranks = [settings.rank(module) for module in pairs]
    targets = sorted({projection for _, projection in pairs.values()})
    return Adapter(files.digest, max(ranks), targets, modules)


def max_weights_bytes(shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of this model within `max_rank` can
    be: every projection of every layer at that rank in float64, and the largest header."""
    per_layer = sum(max_rank * (out + inp) for out, inp in shapes.values())
    return num_layers * per_layer * 8 + MAX_HEADER_BYTES


def _checked_pairs(
    files: AdapterFiles,
    settings: LoraSettings,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    max_rank: int,
) -> dict[str, tuple[int, str]]:
    """Hugging Face module name -> (layer, projection) of every A/B pair the header holds,
    each checked: a known projection, a floating dtype, both matrices, a rank within
    `max_rank` and the config's, shapes that fit the model."""
    header = files.header()
    where = files.path / WEIGHTS_FILE
    found: dict[str, dict[str, list[int]]] = defaultdict(dict)
    pairs: dict[str, tuple[int, str]] = {}
    for key, (dtype, shape) in header.items():
        module, which, layer, projection = lora_module(key, num_layers)
        check_dtype(key, dtype)
        found[module][which] = shape
        pairs[module] = (layer, projection)
    if not pairs:
        raise invalid(f"{where} holds no LoRA tensors")
    for module, (_, projection) in pairs.items():
        if set(found[module]) != {"A", "B"}:
            raise invalid(f"{where}: {module} has lora_{''.join(found[module])} only")
        r = settings.rank(module)
        if r > max_rank:
            raise invalid(f"{module} has rank {r}, over --max-lora-rank {max_rank}")
        out, inp = shapes[projection]
        for which, expected in (("A", [r, inp]), ("B", [out, r])):
            got = found[module][which]
            if got != expected:
                raise invalid(
                    f"base_model.model.{module}.lora_{which}.weight has shape {got}, this model "
                    f"needs {expected} (rank {r}): an adapter made for another model?"
                )
    return pairs


def _merged_pair(
    linear: Any,
    parts: list[tuple[str | int | None, torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> ModuleLora:
    """One pair for a projection from its targeted shards' pairs: A stacked, B block-diagonal
    over the shards' output slices (zero where a shard is not targeted)."""
    parts = sorted(parts, key=lambda part: linear.local_rows(part[0])[0])
    a_cat = torch.cat([a for _, a, _ in parts])
    b_t = torch.zeros(a_cat.shape[0], linear.output_size)
    row = 0
    for shard, a, b in parts:
        offset, size = linear.local_rows(shard)
        b_t[row : row + a.shape[0], offset : offset + size] = b.t()
        row += a.shape[0]
    return ModuleLora(
        a_cat.t().contiguous().to(device=device, dtype=dtype),
        b_t.to(device=device, dtype=dtype),
    )


def projection_shapes(config: Any, head_dim: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each Hugging Face projection of one decoder layer, unsharded."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def hf_module_names(num_layers: int) -> list[str]:
    """The Hugging Face module names of a Llama-family model, what PEFT matches a regex
    `target_modules` against."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb"]
    names.append("lm_head")
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn", f"{layer}.mlp"]
        names += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        names += [f"{layer}.{block}.{proj}" for proj, block in PROJECTIONS.items()]
    return names
