"""GGUF files of each family, written in the test from a tiny checkpoint as llama.cpp writes
them (`gguf_families`), convert into a Hugging Face directory that holds exactly the file's
dequantized weights, with the family's config, and run as transformers runs that directory."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_families import read_as_hf, storage_types, write_bpe_tokenizer, write_gguf
from runner_driver import Driver, assert_greedy_as_transformers
from safetensors.torch import load_file

from triode.gpu.int4 import load_int4_weights
from triode.gpu.loader import convert_gguf
from triode.gpu.model_runner import ModelRunner
from triode.gpu.models.architectures import CheckpointMismatch
from triode.gpu.models.registry import MODELS
from triode.gpu.tiny_model import build_tiny_model

# a sliding window of 8, shorter than the prompt, and a global layer between sliding ones
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"architecture": "qwen3", "head_dim": 16},
    "gemma3": {
        "architecture": "gemma3",
        "num_layers": 3,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,  # llama.cpp's query scale: 1/sqrt(head size)
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 30.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # the global layers'
    },
    "qwen3_moe": {
        "architecture": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,  # llama.cpp always renormalises Qwen3-MoE's top k
    },
    "mixtral": {"architecture": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    # the default model's family, for reference: its Q and K rows are permuted in the file
    "llama": {"architecture": "llama"},
}
# how each file stores its projections (the others: Q4_0); both 4-bit formats' codes are kept
PROJECTIONS = {"qwen3_moe": GGMLQuantizationType.Q4_1}
# what config.json of the converted directory must say, beyond the sizes every family has
CONFIG_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 16,
        "final_logit_softcapping": 30.0,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": 16,
        "num_local_experts": 4,  # transformers' spelling of Qwen3-MoE's num_experts
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "llama": {"architectures": ["LlamaForCausalLM"], "head_dim": 16},
}
PROMPT_TOKENS = 21
NEW_TOKENS = 10


class Family:
    """A tiny checkpoint, its GGUF file and the file converted."""

    def __init__(self, source: Path, gguf: Path, converted: Path) -> None:
        self.source, self.gguf, self.converted = source, gguf, converted
        self.source_config = json.loads((source / "config.json").read_text())
        self.config = json.loads((converted / "config.json").read_text())
        self.source_weights = load_file(source / "model.safetensors")
        self.weights = load_file(converted / "model.safetensors")


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch) -> Path:
    """The module's folder, and its conversions' cache."""
    path = tmp_path_factory.mktemp("gguf")
    monkeypatch_module.setenv("TRIODE_CACHE", str(path / "cache"))
    return path


@pytest.fixture(scope="module")
def tokenizer(root: Path) -> Path:
    """A small byte-level BPE vocabulary with merges: gguf's reader takes seconds over the
    default model's 49152 tokens and merges, each time a file is opened."""
    return write_bpe_tokenizer(root / "tokenizer")


@pytest.fixture(scope="module")
def families(root: Path, tokenizer: Path) -> dict[str, Family]:
    out = {}
    for name, spec in FAMILIES.items():
        source = build_tiny_model(root / name, tokenizer_from=tokenizer, **spec)
        projection = PROJECTIONS.get(name, GGMLQuantizationType.Q4_0)
        gguf = write_gguf(source, root / f"{name}.gguf", projection_type=projection)
        out[name] = Family(source, gguf, convert_gguf(gguf))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_weights_are_the_files_dequantized_tensors(
    families: dict[str, Family], name: str
) -> None:
    family = families[name]
    assert sorted(family.weights) == sorted(family.source_weights)
    expected = read_as_hf(family.gguf, family.source_config, sorted(family.source_weights))
    for key, weight in family.weights.items():
        assert weight.dtype == torch.float32, key
        assert torch.equal(weight, expected[key]), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_weights_are_the_checkpoints_up_to_quantization(
    families: dict[str, Family], name: str
) -> None:
    family = families[name]
    kinds = set(storage_types(family.gguf).values())
    projection = PROJECTIONS.get(name, GGMLQuantizationType.Q4_0)
    assert {projection, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32} <= kinds
    for key, original in family.source_weights.items():
        converted = family.weights[key]
        assert converted.shape == original.shape, key
        if original.dim() == 1 or ".gate." in key:  # norms and routers: float32 in the file
            # Gemma's norms are stored as 1 + weight: one float32 rounding each way
            torch.testing.assert_close(converted, original, atol=2.5e-7, rtol=0)
        else:
            # 4 bits: within a step of a block's 16 levels; Q8_0 (the embedding) far less
            step = original.abs().amax() / 8
            assert (converted - original).abs().max() <= step, key
            assert not torch.equal(converted, original), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_config_names_the_family_and_its_fields(
    families: dict[str, Family], name: str
) -> None:
    family = families[name]
    for field, value in CONFIG_FIELDS[name].items():
        assert family.config[field] == value, field
    for field in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert family.config[field] == family.source_config[field], field
    assert family.config["rms_norm_eps"] == pytest.approx(family.source_config["rms_norm_eps"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_kept_4_bit_codes_are_the_dense_projections(families: dict[str, Family], name: str) -> None:
    family = families[name]
    int4 = load_int4_weights(family.converted)
    layers = family.source_config["num_hidden_layers"]
    attention = {
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in "qkvo"
    }
    # every 2-D 4-bit projection: attention in all, the MLP in the dense families; a MoE layer's
    # stacked experts (3-D) stay dense-only
    assert attention <= set(int4)
    assert all(".experts." not in key for key in int4)
    if "num_local_experts" not in family.config:
        assert f"model.layers.{layers - 1}.mlp.down_proj.weight" in int4
    for key, weight in int4.items():
        assert torch.equal(weight.dequantize(), family.weights[key]), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_tokenizer_is_the_checkpoints(families: dict[str, Family], name: str) -> None:
    from transformers import AutoTokenizer

    family = families[name]
    theirs = AutoTokenizer.from_pretrained(family.source)
    ours = AutoTokenizer.from_pretrained(family.converted)
    text = "<|im_start|>user\nWhat is 17 + 25? Ünïcode, too.<|im_end|>\n"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.convert_tokens_to_ids("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.chat_template == theirs.chat_template


def test_a_file_missing_a_layers_tensors_is_refused(root: Path, tokenizer: Path) -> None:
    """A parameter the file does not fill is one clear error, not random weights."""
    source = build_tiny_model(
        root / "cut", tokenizer_from=tokenizer, num_layers=1, hidden_size=32, num_heads=2
    )
    gguf = write_gguf(source, root / "cut.gguf", omit={"blk.0.ffn_down.weight"})
    with pytest.raises(CheckpointMismatch, match=r"mlp\.down_proj"):
        convert_gguf(gguf)


def test_a_files_sampling_settings_become_the_generation_config(
    root: Path, tokenizer: Path
) -> None:
    """llama.cpp's `general.sampling.*` keys are the request defaults of the converted model
    (`--generation-config auto`); a file without them gets no generation config."""
    source = build_tiny_model(
        root / "sampled", tokenizer_from=tokenizer, num_layers=1, hidden_size=32, num_heads=2
    )
    (source / "generation_config.json").unlink(missing_ok=True)
    plain = convert_gguf(write_gguf(source, root / "plain.gguf"))
    assert not (plain / "generation_config.json").exists()
    settings = {"temp": 0.25, "top_p": 0.875, "top_k": 40, "min_p": 0.0625, "penalty_repeat": 1.5}
    converted = convert_gguf(write_gguf(source, root / "sampled.gguf", sampling=settings))
    config = json.loads((converted / "generation_config.json").read_text())
    assert config == {
        "temperature": 0.25, "top_p": 0.875, "top_k": 40, "min_p": 0.0625,
        "repetition_penalty": 1.5,
    }  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_runner_on_the_converted_file_decodes_as_transformers(
    families: dict[str, Family], name: str
) -> None:
    from transformers import AutoModelForCausalLM

    family = families[name]
    architecture = family.config["architectures"][0]
    if architecture not in MODELS:
        pytest.skip(f"no implementation of {architecture} is registered in gpu/models")
    prompt = random.Random(name).choices(range(3, 250), k=PROMPT_TOKENS)
    runner = ModelRunner(
        family.converted,
        dtype="float32",
        quantization="none",
        kv_cache_memory=1 << 21,
        max_model_len=256,
        num_threads=1,
    )
    d = Driver(runner)
    d.add("r", prompt)
    d.run(NEW_TOKENS)
    seq = d.seqs["r"]
    hf = AutoModelForCausalLM.from_pretrained(family.converted, dtype=torch.float32).eval()
    assert_greedy_as_transformers(seq, hf, NEW_TOKENS)
