"""A model's weights from a model directory: dense tensors, and a GGUF file's weights as the
file stores them (`gguf_file`), run by the kernels that take them with no dense copy kept.

A weight the kernels hold alone (every projection, the LM head and the embedding where a kernel
took them) exists only as the file's blocks: the model's dense parameter of it is emptied, and
`LlamaForCausalLM.load_weights` counts it as loaded. Any other stored weight (a type no kernel
here runs, a projection a tensor-parallel cut would split inside a block, `--quantization none`)
is dequantized to float32 at load, one tensor at a time, into its dense parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from . import gguf_kernels
from .gguf_file import describe, has_manifest, packed_weights
from .gguf_weight import GgufWeight
from .model_files import safetensors_weights
from .quant_matmul import Quantized

log = logging.getLogger(__name__)


def load_checkpoint(
    model: Any, model_dir: Path, dtype: torch.dtype, quantization: str | None, integer: bool = False
) -> int:
    """Load `model_dir` into `model`: its stored weights held by the kernels under
    `quantization` ("auto"; "dense-head" keeps the LM head dense; None: no kernel runs them;
    `integer`: in the integer mode where a type has one), the rest dense. Returns how many
    projections run stored weights; raises as `load_weights`."""
    stored = dict(packed_weights(model_dir)) if has_manifest(model_dir) else {}
    count, held = 0, set()
    if stored and quantization is not None:
        head = quantization != "dense-head"
        count, held = hold_stored_weights(model, stored, dtype, head, integer)
    dense = chain(safetensors_weights(model_dir), _dequantized(model, stored, held))
    model.load_weights(dense, held=held)
    return count


def attach_stored(
    model: Any, model_dir: Path, dtype: torch.dtype, quantization: str | None, integer: bool = False
) -> int:
    """Run the stored weights of `model_dir` (a GGUF file's directory) under `quantization`
    (as `load_checkpoint`) as a start on it does: the dense weights just loaded from it (an
    update from disk) go where the kernels hold them alone. Returns how many projections took
    them; 0 for a directory of dense weights only."""
    if quantization is None or not has_manifest(model_dir):
        return 0
    stored: dict[str, Quantized] = dict(packed_weights(model_dir))
    return hold_stored_weights(model, stored, dtype, quantization != "dense-head", integer)[0]


def hold_stored_weights(
    model: Any,
    weights: Mapping[str, Quantized],
    dtype: torch.dtype,
    head: bool = True,
    integer: bool = False,
) -> tuple[int, set[str]]:
    """Run the GGUF file's blocks (`weights`, by Hugging Face name) where kernels take them
    (`integer`: in the integer mode where a type has one) and keep no dense copy of what they
    alone hold: the projections' (`head`: the LM head's too) and the embedding's rows,
    gathered in `dtype`. Returns (projections that took them, the model's parameters they hold
    alone: load the others)."""
    if not head and model.lm_head is not None:
        weights = {k: w for k, w in weights.items() if k != model.lm_head_source()}
    count, taken = model.attach_quantized_weights(weights, integer)
    embed = "model.embed_tokens.weight"
    stored = weights.get(embed)
    if isinstance(stored, GgufWeight) and model.model.first_stage:
        model.model.embed_tokens.attach_stored(stored, dtype)
    tied_head = model.config.tie_word_embeddings and model.lm_head is not None
    held = taken - {embed}  # a tied embedding: held only where the head took it too
    if isinstance(stored, GgufWeight) and (embed in taken or not tied_head):
        held.add(embed)
    params = dict(model.named_parameters())
    targets = {target for name in held for target, _ in model.checkpoint_targets(name)}
    for target in targets:
        params[target].data = params[target].data.new_empty(0)
    for module in model.modules():  # and the oneDNN copies of what was dropped
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0:
            if getattr(module, "packed", None) is not None:
                module.packed = None
    return count, targets


def _dequantized(
    model: Any, stored: Mapping[str, GgufWeight], held: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored weights no kernel holds alone, dequantized to float32 one at a time for the
    dense parameters, with one log line for those of a type no kernel here runs."""
    rest = {
        name: weight
        for name, weight in stored.items()
        if not held.issuperset(t for t, _ in model.checkpoint_targets(name))
    }
    odd = {n: w for n, w in rest.items() if w.kind not in gguf_kernels.SUPPORTED}
    if odd:
        cost = sum(w.shape[0] * w.shape[1] for w in odd.values()) * 4 / 2**20
        log.warning(
            "no kernel for %d weights of the file, dequantized at load (%.0f MiB as float32): %s",
            len(odd), cost, ", ".join(f"{n} {describe(w)}" for n, w in list(odd.items())[:8]),
        )  # fmt: skip
    for name, weight in rest.items():
        yield name, weight.dequantize()
