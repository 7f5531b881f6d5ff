"""Where a model's weights come from: a Hugging Face directory, a GGUF file served in place, or
the random-weight `tiny-random` model built once.

The model runner reads Hugging Face directories (config.json, *.safetensors, tokenizer
files). For a GGUF file such a directory under `$TRIODE_CACHE/converted/` (`cache_paths`),
keyed by the file's path, size and mtime (and the layout version of the directory), holds what
transformers makes of the file's metadata (config, tokenizer, sampling defaults), the few
tensors the model keeps dense, and the manifest of the weights read from the file itself where
they lie (`gguf_file`), so a replaced file converts again and an unchanged one resolves in
milliseconds. The name `tiny-random` is
a two-layer Llama with random weights under `$TRIODE_CACHE/tiny-random/`: the model costs next
to nothing, so a benchmark of it measures everything around the model. Both are written into a
temporary directory renamed into place at the end: concurrent starts never see half a model,
and the loser of a race throws its copy away.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cache_paths import TINY_RANDOM, converted_dir, default_gguf, tiny_random_dir
from .models.architectures import CheckpointMismatch
from .tiny_model import build_tiny_model

log = logging.getLogger(__name__)


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face directory to load for `model`.

    None means the default model; `"tiny-random"` is the random-weight tiny model, built on
    first use (a few seconds; a directory of that name is reached as `./tiny-random`); a `.gguf`
    path is converted on first use (~30 s); a directory is used as it is. Raises
    FileNotFoundError with what to do when there is nothing to load.
    """
    if model is None:
        path = default_gguf()
        if not path.is_file():
            raise FileNotFoundError(f"the default model {path} is missing: run `make model`")
        return convert_gguf(path)
    if model == TINY_RANDOM:
        return tiny_random()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path)
    raise FileNotFoundError(f"{model}: not a model directory or a .gguf file")


def convert_gguf(gguf: Path) -> Path:
    """Convert `gguf` to a Hugging Face directory unless that was done before; return it."""
    gguf = gguf.resolve()
    return build_once(converted_dir(gguf), lambda tmp: _write_hf_dir(gguf, tmp))


def transformers_directory(model_dir: Path) -> Path:
    """`model_dir` as transformers reads a checkpoint: itself, or for a GGUF file's converted
    directory a sibling holding every weight of the file dequantized to float32 (written once,
    the size of a dense copy: for references and tools, never for serving)."""
    # torch (through gguf_file) only for a GGUF file's directory, as in `_write_hf_dir`
    from .gguf_file import MANIFEST, ROWS

    if not (model_dir / MANIFEST).is_file():
        return model_dir

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file  # a conversion's import, as in `_write_hf_dir`

        from .model_files import checkpoint_weights

        for path in model_dir.iterdir():
            if path.is_file() and path.name not in (MANIFEST, ROWS, "model.safetensors"):
                shutil.copy2(path, tmp / path.name)
        tensors = {name: t.contiguous() for name, t in checkpoint_weights(model_dir)}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})

    return build_once(model_dir.with_name(model_dir.name + "-dense"), write)


def tiny_random() -> Path:
    """Build the `tiny-random` model unless that was done before; return its directory.

    Its vocabulary is the default model's when that was converted before the first build (a
    realistic tokenizer for benchmarks), else a byte-level one; delete the directory to rebuild.
    """

    def build(tmp: Path) -> None:
        build_tiny_model(tmp, hidden_size=64, num_layers=2, max_position_embeddings=2048)

    return build_once(tiny_random_dir(), build)


def build_once(out: Path, write: Callable[[Path], None]) -> Path:
    """`out`, written by `write` into a temporary sibling renamed into place unless it exists."""
    if out.is_dir():  # only ever created complete, by the rename below
        return out
    log.info("building %s (once; later starts reuse it)", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_dir(gguf: Path, out: Path) -> None:
    """Write config, tokenizer and the manifest of the file's weights (`gguf_file`): the
    weights stay in the file, read in place at load, but for the few the model keeps dense
    (float32 norms, tensors whose values the mapping changes), which go to `model.safetensors`
    dequantized to float32. Stacked experts are read in place too, each expert's rows as its
    own projection (`gguf_experts`).

    transformers' own GGUF mapping does the names, each architecture's fix-ups (llama's rotary
    row order, Gemma's norms, stacked experts) and the dense tensors' dequantization; it is
    driven with a meta-device skeleton of the model instead of `from_pretrained(gguf_file=...)`,
    which would need `accelerate`, materialise the model twice and refuse to save it. The dense
    weights are saved as the model's `save_pretrained` lays them out (experts one tensor each,
    by their checkpoint names), as a Hugging Face directory of the family holds them.

    torch and transformers are imported here, only for a conversion: resolving a model
    converted before takes milliseconds, without them.
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from .gguf_file import write_manifest

    # gguf's reader parses every metadata array on opening (a large vocabulary takes seconds):
    # one reader serves the config's fixes and the tensors
    log.info("%s: reading its metadata (once for this file)", gguf.name)
    reader = GGUFReader(gguf)
    config = _complete_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), reader)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    processor, names = _tensor_mapping(reader, skeleton)
    log.info("%s: mapping its %d tensors", gguf.name, len(reader.tensors))
    entries, orders, tensors = _split_tensors(reader, processor, names, skeleton)
    tensors = {k: t.contiguous() for k, t in revert_weight_conversion(skeleton, tensors).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_manifest(gguf, entries, orders, out)
    config.save_pretrained(out)
    log.info("%s: %d weights served from the file; building the tokenizer", gguf.name, len(entries))
    _tokenizer(gguf, reader).save_pretrained(out)
    defaults = _sampling_defaults(reader)
    if defaults:
        (out / "generation_config.json").write_text(json.dumps(defaults, indent=2))


# the sampling settings a GGUF file may carry (`general.sampling.*`, as llama.cpp writes them
# from a model's generation_config.json) -> the generation config's names
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _sampling_defaults(reader: Any) -> dict[str, float]:
    """The file's sampling settings as a generation config (`generation_config.py` takes the
    request defaults from it); empty where it has none."""
    values = {name: _field(reader, key) for key, name in _GGUF_SAMPLING.items()}
    return {name: value for name, value in values.items() if value is not None}


def _tokenizer(gguf: Path, reader: Any) -> Any:
    """transformers' tokenizer of the file, in a class that loads back as it is.

    For a byte-level BPE vocabulary (`gpt2`), transformers builds the tokenizer the file
    describes (its pre-tokenizer from `tokenizer.ggml.pre`, as llama.cpp splits text) but names
    the family's class, which on loading rebuilds its own pipeline over the vocabulary (Qwen's
    digit splitting, Gemma's SentencePiece spaces): the directory would tokenize otherwise than
    the file. Such a tokenizer is saved in the generic class, which loads tokenizer.json as it is.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # as in `_write_hf_dir`

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        return tokenizer
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        pad_token=tokenizer.pad_token,
        chat_template=tokenizer.chat_template,
    )


def _field(reader: Any, key: str) -> Any:
    """A metadata value of the file (None where it has none)."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _complete_config(config: Any, reader: Any) -> Any:
    """transformers' config of the file with what its GGUF reader leaves out or gets wrong.

    - `attention.key_length` is the head size; transformers reads it for some families only
      (Qwen3's config would otherwise keep its default of 128);
    - Qwen3-MoE: `expert_feed_forward_length` is the experts' size (`moe_intermediate_size`) and
      `expert_weights_norm`, where the file has it, `norm_topk_prob`;
    - Gemma 3: `attention.sliding_window_pattern` (a flag per layer), where the file has it, is
      `layer_types` (without it, one global layer in six, as llama.cpp and transformers both
      assume); the query scale is llama.cpp's: 1/sqrt(head size), which transformers spells
      `query_pre_attn_scalar` (Gemma 3 27B, 62 layers, scales by hidden size / heads instead);
      a linear `rope.scaling` (Gemma 3 4B and up) applies to the global layers' rotary
      embedding only; `final_logit_softcapping` where the file has it;
    - Mixtral's files are `llama` with `expert_count`: transformers reads a Llama config and
      would drop the experts; it becomes a Mixtral config.
    """
    from transformers import MixtralConfig  # a conversion's import, as in `_write_hf_dir`

    architecture = _field(reader, "general.architecture")
    head_dim = _field(reader, f"{architecture}.attention.key_length")
    if head_dim is not None and hasattr(config, "head_dim"):
        config.head_dim = int(head_dim)
    experts = _field(reader, f"{architecture}.expert_count")
    if config.model_type == "qwen3_moe":
        expert_size = _field(reader, f"{architecture}.expert_feed_forward_length")
        if expert_size is not None:
            config.moe_intermediate_size = int(expert_size)
        norm = _field(reader, f"{architecture}.expert_weights_norm")
        if norm is not None:
            config.norm_topk_prob = bool(norm)
    if config.model_type == "gemma3_text":
        pattern = _field(reader, f"{architecture}.attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == config.num_hidden_layers:
            config.layer_types = [
                "sliding_attention" if sliding else "full_attention" for sliding in pattern
            ]
        if config.num_hidden_layers == 62:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim
        if _field(reader, f"{architecture}.rope.scaling.type") == "linear":
            factor = float(_field(reader, f"{architecture}.rope.scaling.factor"))
            scaled = {"rope_type": "linear", "factor": factor}
            config.rope_parameters["full_attention"] |= scaled
        softcap = _field(reader, f"{architecture}.final_logit_softcapping")
        if softcap is not None:
            config.final_logit_softcapping = float(softcap)
    if config.model_type == "llama" and experts:
        fields = config.to_dict()
        kept = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id",
        )  # fmt: skip
        config = MixtralConfig(
            **{key: fields[key] for key in kept if key in fields},
            num_local_experts=int(experts),
            num_experts_per_tok=int(_field(reader, f"{architecture}.expert_used_count")),
        )
    return config


def _tensor_mapping(reader: Any, skeleton: Any) -> tuple[Any, dict[str, str]]:
    """transformers' tensor processor for the file's architecture and its GGUF name -> Hugging
    Face name map for `skeleton`.

    Mixtral, llama with experts, is not one transformers maps: its processor here is llama's
    (Q and K rows back to the rotary halves) with Qwen-MoE's stacked experts, over llama's
    tensor names.
    """
    # a conversion's imports, as in `_write_hf_dir`
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        Qwen2MoeTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
        def process(self, weights: Any, name: str, **kwargs: Any) -> Any:
            if ".attn_q." in name or ".attn_k." in name:
                return LlamaTensorProcessor(self.config).process(weights, name, **kwargs)
            return super().process(weights, name, **kwargs)

    architecture = _field(reader, "general.architecture")
    config = skeleton.config.to_dict()
    if skeleton.config.model_type == "mixtral":
        processor = MixtralTensorProcessor(config=config)
        return processor, get_gguf_hf_weights_map(skeleton, processor, model_type="llama")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    return processor, get_gguf_hf_weights_map(skeleton, processor)


def _split_tensors(
    reader: Any, processor: Any, names: dict[str, str], skeleton: Any
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The file's tensors under the skeleton's names, split: (manifest entries of the weights
    kept packed in the file, their row orders where the mapping moves rows, the dense tensors
    dequantized to float32 as transformers' `load_gguf_checkpoint` makes them).
    CheckpointMismatch when a parameter of the model gets no tensor (a tied LM head excepted)."""
    # a conversion's imports, as in `_write_hf_dir`
    import numpy as np
    import torch
    from gguf import dequantize

    # a conversion's imports, as in `_write_hf_dir`
    from .gguf_experts import expert_entries
    from .gguf_file import keeps_packed

    entries: list[dict[str, Any]] = []
    orders: dict[str, Any] = {}
    parsed: dict[str, Any] = {"tensors": {}}
    stacked: set[str] = set()  # the parameters that stacked experts read in place fill
    for tensor in reader.tensors:
        kind, dims = int(tensor.tensor_type), [int(d) for d in tensor.shape]
        found = None
        if keeps_packed(kind, len(dims)) and len(dims) == 3:  # stacked experts
            experts = expert_entries(processor, names, skeleton, tensor)
            if experts is not None:
                entries += experts[0]
                stacked |= experts[1]
                continue
        elif keeps_packed(kind, len(dims)):
            found = _row_order(processor, names, tensor.name, dims[1])
        if found is not None:
            name, order = found
            entries.append(
                {"name": name, "kind": kind, "offset": int(tensor.data_offset),
                 "rows": dims[1], "cols": dims[0]}
            )  # fmt: skip
            if not np.array_equal(order, np.arange(dims[1])):
                orders[name] = torch.from_numpy(order)
            continue
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        if result.name in names:
            weights = np.asarray(result.weights, dtype=np.float32)
            parsed["tensors"][names[result.name]] = torch.from_numpy(np.copy(weights))
    tensors: dict[str, Any] = parsed["tensors"]
    tied = "lm_head.weight" if skeleton.config.tie_word_embeddings else None
    present = set(tensors) | {entry["name"] for entry in entries} | stacked
    missing = sorted(set(skeleton.state_dict()) - present - {tied})
    if missing:
        raise CheckpointMismatch(
            f"the GGUF file has no tensor for {len(missing)} parameters of "
            f"{type(skeleton).__name__}: {', '.join(missing[:4])}"
        )
    return entries, orders, tensors


def _row_order(processor: Any, names: dict[str, str], gguf_name: str, rows: int) -> Any:
    """(Hugging Face name, GGUF row of each Hugging Face row) or None when the mapping does more
    than reorder rows: the processor runs on the row indices instead of the values."""
    import numpy as np  # a conversion's import, as in `_write_hf_dir`

    index = np.arange(rows, dtype=np.float64)[:, None]
    try:
        result = processor.process(
            weights=index, name=gguf_name, tensor_key_mapping=names, parsed_parameters={}
        )
    except Exception:  # a processor that needs more than rows to work on: not ours to move
        return None
    name = names.get(result.name)
    moved = np.asarray(result.weights)
    if name is None or moved.shape != (rows, 1):
        return None
    order = moved[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return name, order
