"""New weights for a running model: a checkpoint directory or a trainer's tensors checked against
the model's architecture before anything is written, then written where the model keeps them.

Names are Hugging Face's and shapes the full, unsharded ones, whatever this rank's share: the
model's `load_weights` cuts each rank's shard and skips other pipeline stages' tensors. The
shapes come from transformers' own model of the architecture built on the meta device (no
memory), so a trainer's `named_parameters()` is accepted as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig

from triode.wire import OperationError

from .gguf_file import has_manifest, stored_shapes
from .layers import LinearBase
from .models.llama import LlamaForCausalLM, head_dim
from .models.moe import Experts

# safetensors dtypes a weight may come in (cast to the model's dtype on loading)
FLOATING = frozenset({"F16", "BF16", "F32", "F64"})
# config fields a new checkpoint must share with the running model: they decide which tensors
# exist and their shapes (head_dim as resolved, whether config.json names it or not)
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    # a mixture of experts': how many, of which size, on which layers
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)
# a config.json is a few kB; anything near this is no model's
MAX_CONFIG_BYTES = 1 << 20
# buffers older checkpoints carry, which loading skips (the model computes its own)
SKIPPED = "rotary_emb.inv_freq"

Weights = Sequence[tuple[str, torch.Tensor]]


def checkpoint_layout(
    skeleton: nn.Module, params: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """A transformers model's parameters as its checkpoints name and shape them."""
    # transformers' model loading takes 0.65 s to import: a model process that never checks an
    # update does without it
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(skeleton, dict(params))


def invalid(message: str) -> OperationError:
    return OperationError("invalid", message)


class Architecture:
    """The Hugging Face tensors of a model's architecture (from its config), by name, with
    their full shapes; `required` leaves out the tied LM head, which checkpoints omit."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.name = (getattr(config, "architectures", None) or ["?"])[0]
        # transformers' model classes load with its model loading: imported on first check
        from transformers import AutoModelForCausalLM

        # transformers may set attributes on the config it builds from: a copy takes them
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        # by the names checkpoints hold (transformers keeps a mixture's experts stacked in the
        # module and saves them one tensor per expert, as the families load them)
        params = checkpoint_layout(skeleton, skeleton.named_parameters(remove_duplicate=False))
        self.shapes = {name: tuple(p.shape) for name, p in params.items()}
        self.required = list(checkpoint_layout(skeleton, skeleton.named_parameters()))

    def check_tensor(self, name: str, shape: Sequence[int], dtype: str, floating: bool) -> None:
        """OperationError `invalid` unless `name` is a tensor of this architecture of its full
        shape in a floating dtype."""
        if SKIPPED in name:
            return
        expected = self.shapes.get(name)
        if expected is None:
            raise invalid(f"tensor {name!r} is no parameter of {self.name}")
        if tuple(shape) != expected:
            raise invalid(f"tensor {name!r} has shape {list(shape)}; {list(expected)} expected")
        if not floating:
            raise invalid(f"tensor {name!r} is {dtype}, not a floating-point dtype")

    def check_specs(
        self, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], model: LlamaForCausalLM
    ) -> None:
        """OperationError `invalid` unless every (name, dtype, shape) of `specs` is a known
        tensor, each once, with a home in `model`."""
        seen: set[str] = set()
        for spec in specs:
            if not (
                isinstance(spec, tuple)
                and len(spec) == 3
                and isinstance(spec[0], str)
                and isinstance(spec[1], torch.dtype)
            ):
                raise invalid(f"tensors are given by (name, dtype, shape), not {spec!r:.100}")
            name, dtype, shape = spec
            if name in seen:
                raise invalid(f"tensor {name!r} is given twice")
            seen.add(name)
            kind = str(dtype).removeprefix("torch.")
            self.check_tensor(name, shape, kind, dtype.is_floating_point)
        _check_homes(model, seen)

    def check_tensors(self, weights: Weights, model: LlamaForCausalLM) -> None:
        """`check_specs` of (name, tensor) pairs."""
        specs = []
        for item in weights:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise invalid(f"weights are (name, tensor) pairs, not {type(item).__name__}")
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise invalid(f"tensor {name!r} is a {type(tensor).__name__}, not a tensor")
            specs.append((name, tensor.dtype, tuple(tensor.shape)))
        self.check_specs(specs, model)

    def check_checkpoint(self, path: Path, model: LlamaForCausalLM) -> list[str]:
        """The tensor names of checkpoint directory `path`, once its config and every
        tensor's name, shape and dtype (from the files' headers: nothing is loaded) are this
        architecture's and it holds every tensor `model` needs; else OperationError
        `invalid` naming what is wrong."""
        if not path.is_dir():
            raise invalid(f"{path} is not a directory")
        self._check_config(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise invalid(f"{path} has no *.safetensors files")
        found: dict[str, str] = {}
        for file in files:
            if not file.is_file():  # a FIFO would block the open, a device stream forever
                raise invalid(f"{file} is not a regular file")
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        if name in found:
                            raise invalid(f"tensor {name!r} is in {found[name]} and {file.name}")
                        found[name] = file.name
                        tensor = f.get_slice(name)
                        dtype = tensor.get_dtype()
                        self.check_tensor(name, tensor.get_shape(), dtype, dtype in FLOATING)
            except (SafetensorError, OSError) as e:
                raise invalid(f"{file}: {e}") from None
        if has_manifest(path):  # a GGUF file's directory: the file's weights, by its manifest
            try:
                shapes = stored_shapes(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise invalid(f"{path}: its GGUF manifest is unreadable: {e}") from None
            for name, shape in shapes.items():
                if name in found:
                    raise invalid(f"tensor {name!r} is in {found[name]} and the GGUF file")
                found[name] = "the GGUF file"
                self.check_tensor(name, list(shape), "F32", True)
        missing = [n for n in self.required if n not in found and model.checkpoint_targets(n)]
        if missing:
            raise invalid(f"{path} lacks {len(missing)} tensors of the model: {missing[:4]}")
        _check_homes(model, found)
        return list(found)

    def _check_config(self, path: Path) -> None:
        file = path / "config.json"
        if not file.is_file():
            raise invalid(f"{path} has no config.json")
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise invalid(f"{file} is over {MAX_CONFIG_BYTES} bytes")
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:  # whatever transformers raises for a config it cannot read
            raise invalid(f"{file}: {e}") from None
        architectures = getattr(config, "architectures", None) or []
        if architectures != (getattr(self.config, "architectures", None) or []):
            raise invalid(f"{path} holds {architectures}, not {self.name}")
        for field in SHAPE_FIELDS:
            ours, theirs = getattr(self.config, field, None), getattr(config, field, None)
            if field == "head_dim":
                ours, theirs = head_dim(self.config), head_dim(config)
            if ours != theirs:
                raise invalid(f"{file}: {field} is {theirs}, the model's is {ours}")


def _check_homes(model: LlamaForCausalLM, names: Iterable[str]) -> None:
    """Every parameter the tensors `names` go to on this rank is one of `model`'s."""
    params = dict(model.named_parameters())
    for name in names:
        for target, _ in model.checkpoint_targets(name):
            if target not in params:
                raise invalid(f"tensor {name!r} has no home in this model ({target!r})")


def write_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], names: Iterable[str]
) -> tuple[int, int]:
    """Write checked tensors (named `names`, Hugging Face names) into `model`; returns (how many
    parameters were written, how many projections lost their 4-bit codes).

    A projection whose weight takes new values runs them from now on: its oneDNN-packed copy
    is unpacked (`pack_cpu_weights` packs it again) and its 4-bit codes detached, as the
    codes were the old weight's (a server started on the new checkpoint, which has no 4-bit
    codes, runs it dense too). OperationError `unsupported`, before anything is written, where
    a projection kept no weight to write into.
    """
    targets = {target for name in names for target, _ in model.checkpoint_targets(name)}
    touched = _holders(model, targets)
    for module_name, (module, weight) in touched.items():
        if weight and isinstance(module, LinearBase) and module.packed is None:
            if module.weight.numel() == 0 and module.stored is None:
                raise OperationError(
                    "unsupported", f"{module_name} keeps no dense weight to take new values"
                )
    detached = 0
    for module, weight in touched.values():
        if not weight and not isinstance(module, Experts):  # experts: stacked, not `weight`
            continue
        unpack = getattr(module, "unpack", None)
        if unpack is not None:
            unpack()
        detach = getattr(module, "detach_quantized", None)  # the file's blocks are stale now
        if detach is not None and detach():
            detached += 1
    with torch.no_grad():
        written = model.load_weights(weights, partial=True)
    return len(written), detached


def _holders(model: nn.Module, targets: set[str]) -> dict[str, tuple[nn.Module, bool]]:
    """The modules holding the parameters named `targets` (a tied weight: each module sharing
    it), each with whether its `weight` is one of them."""
    params = dict(model.named_parameters())
    wanted = {id(params[t]) for t in targets if t in params}
    holders: dict[str, tuple[nn.Module, bool]] = {}
    for name, module in model.named_modules():
        own = {id(p): key for key, p in module.named_parameters(recurse=False)}
        hit = [key for pid, key in own.items() if pid in wanted]
        if hit:
            holders[name] = (module, "weight" in hit)
    return holders
