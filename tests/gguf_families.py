"""GGUF files of the model families, written from tiny Hugging Face checkpoints the way
llama.cpp's `convert_hf_to_gguf.py` writes them, and read back to Hugging Face names: what the
GGUF tests share.

llama.cpp's conventions, which a reader has to undo:
- gguf's architecture names: `qwen3`, `gemma3`, `qwen3moe`; Mixtral is `llama` with
  `expert_count` / `expert_used_count`;
- gguf's tensor names (`gguf.get_tensor_name_map`), each MoE layer's experts stacked into one
  3-D tensor per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, [experts, out, in]);
- the `llama` architecture's Q and K rows permuted from Hugging Face's rotary layout (half
  split) to llama.cpp's (interleaved pairs); the other families use the half split as it is;
- Gemma's RMS norms stored as 1 + weight (Hugging Face's Gemma multiplies by 1 + weight,
  llama.cpp by the stored weight).

2-D projections (and the stacked experts) are quantized, in blocks of 32 inputs, to
`projection_type`; the token embedding (and an untied LM head) to Q8_0; norms and the MoE router
stay float32.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from safetensors.torch import load_file

from triode.gpu.tiny_model import CHATML_SPECIALS, chatml_tokenizer

# config.json's model_type -> gguf's architecture name
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


@dataclass
class Entry:
    """One GGUF tensor and the Hugging Face weights it holds: one, or a layer's experts in
    order (stacked along a new first axis)."""

    gguf_name: str
    hf_names: list[str]
    permute_heads: int | None = None  # llama's rotary row permutation over this many heads
    norm_shift: float = 0.0  # added on writing, taken off on reading


def write_bpe_tokenizer(path: Path) -> Path:
    """A 320-token byte-level BPE tokenizer (bytes, ChatML's special tokens and 61 merges learnt
    from a few sentences) saved at `path`: the default model's kind of vocabulary, small enough
    that gguf's reader opens a file of it at once."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "What is 17 + 25? The answer is 42.",
        "user assistant system the them there",
    ]
    backend.train_from_iterator(corpus, trainer)
    chatml_tokenizer(backend).save_pretrained(path)
    return path


def tensor_entries(config: dict[str, Any], hf_names: list[str]) -> list[Entry]:
    """How `hf_names` (a checkpoint's tensors, as `save_pretrained` names them) lay out in a GGUF
    file of `config`'s family."""
    architecture = GGUF_ARCHITECTURES[config["model_type"]]
    name_map = gguf.get_tensor_name_map(_arch(architecture), config["num_hidden_layers"])
    experts: dict[str, dict[int, str]] = {}
    entries: list[Entry] = []
    for hf_name in hf_names:
        if m := _EXPERT.match(hf_name):
            key = f"{m['layer']}.{m['proj']}"
            experts.setdefault(key, {})[int(m["index"])] = hf_name
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = name_map.get_name(base)
        if gguf_base is None:
            raise ValueError(f"{hf_name}: no GGUF name in {architecture}")
        entry = Entry(f"{gguf_base}.{suffix}", [hf_name])
        if architecture == "llama" and gguf_base.endswith((".attn_q", ".attn_k")):
            kv = gguf_base.endswith(".attn_k")
            entry.permute_heads = config["num_key_value_heads" if kv else "num_attention_heads"]
        if architecture == "gemma3" and gguf_base.endswith("norm"):
            entry.norm_shift = 1.0
        entries.append(entry)
    for key, by_index in experts.items():
        gguf_base = name_map.get_name(key)
        if gguf_base is None:
            raise ValueError(f"{key}: no GGUF name in {architecture}")
        entries.append(Entry(f"{gguf_base}.weight", [by_index[i] for i in sorted(by_index)]))
    return entries


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    projection_type: GGMLQuantizationType = GGMLQuantizationType.Q4_0,
    embedding_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    omit: Collection[str] = (),
    sampling: dict[str, float | int] | None = None,
) -> Path:
    """`model_dir`'s checkpoint (a `build_tiny_model` directory) as a GGUF file at `out`,
    without the GGUF tensors named in `omit` (a broken file), with `sampling` as the file's
    `general.sampling.*` settings (`top_k` an integer, the others floats)."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    architecture = GGUF_ARCHITECTURES[config["model_type"]]
    writer = GGUFWriter(out, architecture)
    writer.add_name(f"tiny {config['model_type']}")
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, model_dir)
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    for entry in tensor_entries(config, sorted(weights)):
        if entry.gguf_name in omit:
            continue
        data = np.stack([weights[name].float().numpy() for name in entry.hf_names])
        if len(entry.hf_names) == 1:
            data = data[0]
        if entry.permute_heads is not None:
            data = _permute(data, entry.permute_heads)
        data = data + np.float32(entry.norm_shift) if entry.norm_shift else data
        kind = _storage(entry.gguf_name, data, projection_type, embedding_type)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(entry.gguf_name, np.ascontiguousarray(data, dtype=np.float32))
        elif kind in QUANTIZABLE:
            writer.add_tensor(entry.gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:  # a type gguf cannot quantize to: random blocks of the weights' size
            rows = int(np.prod(data.shape[:-1]))
            peak = float(np.abs(data).max())
            blocks = random_blocks(kind, rows, data.shape[-1], seed=len(entry.gguf_name), peak=peak)
            shape = (*data.shape[:-1], blocks.shape[-1])
            writer.add_tensor(entry.gguf_name, blocks.reshape(shape), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def read_as_hf(path: Path, config: dict[str, Any], hf_names: list[str]) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized (`gguf.quants.dequantize`) and laid out back under
    `hf_names` (`config`: the checkpoint's config.json): the inverse of `write_gguf`, whatever
    a loader makes of the file."""
    stored = {t.name: t for t in GGUFReader(path).tensors}
    out: dict[str, torch.Tensor] = {}
    for entry in tensor_entries(config, hf_names):
        tensor = stored[entry.gguf_name]
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = data - np.float32(entry.norm_shift) if entry.norm_shift else data
        if entry.permute_heads is not None:
            data = _unpermute(data, entry.permute_heads)
        if len(entry.hf_names) == 1:
            data = data[None]
        for name, part in zip(entry.hf_names, data, strict=True):
            out[name] = torch.from_numpy(np.array(part, dtype=np.float32))
    return out


def storage_types(path: Path) -> dict[str, GGMLQuantizationType]:
    """Each tensor of the file with its storage type."""
    return {t.name: t.tensor_type for t in GGUFReader(path).tensors}


def _arch(name: str) -> gguf.MODEL_ARCH:
    return next(arch for arch, text in gguf.MODEL_ARCH_NAMES.items() if text == name)


def _storage(
    gguf_name: str,
    data: np.ndarray,
    projection_type: GGMLQuantizationType,
    embedding_type: GGMLQuantizationType,
) -> GGMLQuantizationType:
    if data.ndim < 2 or data.shape[-1] % 32 or ".ffn_gate_inp." in gguf_name:
        return GGMLQuantizationType.F32
    kind = embedding_type if gguf_name.startswith(("token_embd.", "output.")) else projection_type
    size, _ = gguf.GGML_QUANT_SIZES[kind]
    return kind if data.shape[-1] % size == 0 else GGMLQuantizationType.Q8_0


T = GGMLQuantizationType
# the types gguf's numpy code quantizes to
QUANTIZABLE = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16})
# each block type's float16 scale fields: byte offsets of the fields every weight of the block
# is proportional to (d, and dmin where it has one)
SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}  # fmt: skip


def random_blocks(
    kind: GGMLQuantizationType, rows: int, cols: int, seed: int, peak: float = 0.1
) -> np.ndarray:
    """`rows` rows of `cols` weights of type `kind` from random bytes (any codes and sub-scales
    are a valid block), their float16 scale fields set so that the largest weight is about
    `peak`: uint8 [rows, row bytes]. Every weight is linear in a block's scale fields, so they
    are set to 1, measured, and scaled."""
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // size, nbytes), dtype=np.uint8)
    fields = SCALE_FIELDS[kind]
    for offset in fields:
        blocks[:, offset : offset + 2] = np.full(1, 1.0, np.float16).view(np.uint8)
    largest = float(np.abs(gguf.quants.dequantize(blocks, kind)).max()) or 1.0
    scale = np.float16(peak / largest)
    signs = rng.choice(np.array([-1, 1], np.float16), (blocks.shape[0], 1))
    for offset in fields:
        blocks[:, offset : offset + 2] = (scale * signs).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: within each head, rows (i, i + half) become (2i, 2i + 1)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    return (
        weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _rope_theta(config: dict[str, Any]) -> float:
    """The base of the global layers' rotary embedding (Gemma 3's local layers use 10000,
    as llama.cpp assumes)."""
    rope = config["rope_parameters"]
    return float(rope.get("full_attention", rope)["rope_theta"])


def _write_hyperparameters(writer: GGUFWriter, config: dict[str, Any]) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if GGUF_ARCHITECTURES[config["model_type"]] == "llama":
        writer.add_rope_dimension_count(head_dim)
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "norm_topk_prob" in config:
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    if config["model_type"] == "gemma3_text":
        full = config["rope_parameters"]["full_attention"]
        if full["rope_type"] == "linear":  # Gemma 3 4B and up: the global layers' only
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(
            [kind == "sliding_attention" for kind in config["layer_types"]]
        )
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def _write_tokenizer(writer: GGUFWriter, model_dir: Path) -> None:
    """A byte-level BPE vocabulary as llama.cpp writes one (`gpt2`): tokens in id order, each
    added token marked control (special) or user-defined, the merges, the special ids."""
    from transformers import AutoTokenizer  # a second of import, only to write a file

    data = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    kinds = dict.fromkeys(vocab.values(), _TOKEN_NORMAL)
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = _TOKEN_CONTROL if added["special"] else _TOKEN_USER_DEFINED
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([kinds.get(i, _TOKEN_NORMAL) for i in range(len(tokens))])
    if merges:
        writer.add_token_merges(merges)
    else:  # gguf cannot write an empty array; a reader derives merges from scores instead
        writer.add_token_scores([0.0] * len(tokens))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
        (tokenizer.unk_token_id, writer.add_unk_token_id),
    ):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
