"""GGUF files of each family, written in the test from a tiny checkpoint as llama.cpp writes
them (`gguf_families`), convert into a Hugging Face directory that holds exactly the file's
dequantized weights, with the family's config, and run as transformers runs that directory."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_families import read_as_hf, storage_types, write_bpe_tokenizer, write_gguf
from runner_driver import Driver, assert_greedy_as_transformers
from safetensors.torch import load_file

from triode.gpu.gguf_file import MANIFEST, ROWS, mapped_span, packed_weights
from triode.gpu.gguf_weight import GgufStack, GgufWeight
from triode.gpu.loader import convert_gguf, transformers_directory
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
        self.dense = load_file(converted / "model.safetensors")
        self.stored = dict(packed_weights(converted))
        # every weight as the directory serves it: the file's blocks dequantized, the rest dense
        self.weights = self.dense | {k: w.dequantize() for k, w in self.stored.items()}


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
def test_projections_are_read_from_the_file_where_they_lie(
    families: dict[str, Family], name: str
) -> None:
    family = families[name]
    layers = family.source_config["num_hidden_layers"]
    attention = {
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in "qkvo"
    }
    # every 2-D projection and the embedding stay in the file, and each expert's rows of a MoE
    # layer's stacked experts (3-D); the float32 norms are the dense file's
    assert attention | {"model.embed_tokens.weight"} <= set(family.stored)
    assert not any(".experts." in key for key in family.dense)
    assert not set(family.stored) & set(family.dense)
    experts = family.config.get("num_local_experts")
    if experts is None:
        assert f"model.layers.{layers - 1}.mlp.down_proj.weight" in family.stored
    else:
        stacked = [key for key in family.stored if ".experts." in key]
        assert len(stacked) == layers * experts * 3, stacked[:6]
    span = mapped_span(family.converted)
    manifest = json.loads((family.converted / MANIFEST).read_text())
    reordered = {e["name"] for e in manifest["tensors"] if e.get("in") == ROWS}
    rows_span = mapped_span(family.converted, ROWS) if reordered else range(0)
    for key, weight in family.stored.items():
        assert isinstance(weight, GgufWeight)
        assert weight.kind != GGMLQuantizationType.F32
        where = rows_span if key in reordered else span
        assert weight.data.data_ptr() in where, key  # a view of a mapped file, never a copy
    # llama.cpp's rotary row order of Q and K: the only rows the conversion writes again, in
    # the model's order (llama, mixtral)
    assert all("q_proj" in key or "k_proj" in key for key in reordered)
    assert bool(reordered) == (family.config["model_type"] in ("llama", "mixtral"))
    rows_bytes = sum(family.stored[key].nbytes for key in reordered)
    written = sum(p.stat().st_size for p in family.converted.rglob("*") if p.is_file())
    dense = sum(t.numel() * 4 for t in family.dense.values())
    # config, tokenizer, manifest and the reordered rows (each from a page of its own): no other
    # copy of the file's blocks
    assert written <= dense + rows_bytes + 4096 * len(reordered) + 200_000


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
    hf = AutoModelForCausalLM.from_pretrained(
        transformers_directory(family.converted), dtype=torch.float32
    ).eval()
    assert_greedy_as_transformers(seq, hf, NEW_TOKENS)


# --- every type a GGUF file stores weights in ----------------------------------------------

T = GGMLQuantizationType
# the quantized types llama-quantize writes for its presets, and 16-bit floats, each run from
# its blocks as they lie (Q4_0, Q4_1 and Q8_0 above, repacked for their own kernel)
STORED_TYPES = [
    T.Q5_0,
    T.Q5_1,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ4_NL,
    T.IQ4_XS,
    T.F16,
    T.BF16,
]


@pytest.fixture(scope="module")
def wide_llama(root: Path, tokenizer: Path) -> Path:
    """A llama whose rows are whole blocks of 256 (the K-quants' and IQ4_XS' size)."""
    return build_tiny_model(
        root / "wide-llama", tokenizer_from=tokenizer, hidden_size=256, intermediate_size=512,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip


@pytest.mark.parametrize("kind", STORED_TYPES, ids=lambda kind: kind.name)
def test_every_stored_type_runs_from_the_file_and_decodes_as_transformers(
    root: Path, wide_llama: Path, kind: GGMLQuantizationType
) -> None:
    from transformers import AutoModelForCausalLM

    from triode.gpu.layers import LinearBase
    from triode.gpu.quant_matmul import GgufRows

    gguf = write_gguf(
        wide_llama, root / f"llama-{kind.name}.gguf", projection_type=kind, embedding_type=kind
    )
    assert set(storage_types(gguf).values()) == {kind, T.F32}
    converted = convert_gguf(gguf)
    runner = ModelRunner(
        converted, dtype="float32", kv_cache_memory=1 << 21, max_model_len=256, num_threads=1
    )
    projections = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert runner.quantized_projections == len(projections) + 1  # and the tied LM head
    for module in [*projections, runner.model.lm_head]:
        assert isinstance(module.quant, GgufRows) and module.weight.numel() == 0
    assert runner.model.model.embed_tokens.stored is not None  # rows gathered from the file
    prompt = random.Random(kind.name).choices(range(3, 250), k=PROMPT_TOKENS)
    d = Driver(runner)
    d.add("r", prompt)
    d.run(NEW_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(
        transformers_directory(converted), dtype=torch.float32
    ).eval()
    assert_greedy_as_transformers(d.seqs["r"], hf, NEW_TOKENS)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("mode", ["exact", "integer"])
def test_a_moe_files_experts_run_from_its_blocks(
    families: dict[str, Family], name: str, mode: str
) -> None:
    """Each expert's gate, up and down rows run from the file (no dense copy of the experts),
    and the model decodes as transformers on the same file (exactly; the integer mode as the
    dense one with x rounded: its first log-probabilities within 0.15)."""
    from transformers import AutoModelForCausalLM

    from triode.gpu.models.moe import Experts
    from triode.gpu.quant_matmul import GgufRows, QuantRows

    family = families[name]
    options = {"dtype": "float32", "kv_cache_memory": 1 << 21, "max_model_len": 256}
    runner = ModelRunner(family.converted, gguf_arithmetic=mode, num_threads=1, **options)
    blocks = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert blocks and all(b.w13.numel() == 0 and b.w2.numel() == 0 for b in blocks)
    for block in blocks:
        assert block.expert_kernels is not None and len(block.expert_kernels) == block.count
        kernel = GgufRows if mode == "integer" else QuantRows  # Q4_0 exact: repacked
        assert all(isinstance(k, kernel) for pair in block.expert_kernels for k in pair)
    prompt = random.Random(name).choices(range(3, 250), k=PROMPT_TOKENS)
    d = Driver(runner)
    d.add("r", prompt)
    d.run(NEW_TOKENS)
    if mode == "exact":
        hf = AutoModelForCausalLM.from_pretrained(
            transformers_directory(family.converted), dtype=torch.float32
        ).eval()
        assert_greedy_as_transformers(d.seqs["r"], hf, NEW_TOKENS)
        return
    dense = ModelRunner(family.converted, quantization="none", num_threads=1, **options)
    reference = Driver(dense)
    reference.add("r", prompt)
    reference.run(1)
    got, want = d.seqs["r"].logprobs[0].logprobs, reference.seqs["r"].logprobs[0].logprobs
    assert not np.array_equal(got, want) and np.abs(got - want).max() < 0.15


def test_a_weight_update_dequantizes_a_moe_layers_experts_first(
    families: dict[str, Family],
) -> None:
    from triode.gpu.models.moe import Experts
    from triode.gpu.weight_updates import write_weights

    family = families["qwen3_moe"]
    runner = ModelRunner(
        family.converted, dtype="float32", kv_cache_memory=1 << 21, max_model_len=256, num_threads=1
    )
    block = next(m for m in runner.model.modules() if isinstance(m, Experts))
    before = torch.stack([w.dequantize() for w, _ in block.stored])
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    new = torch.randn(runner.model.config.hidden_size, block.intermediate_size)
    written, detached = write_weights(runner.model, [(name, new)], [name])
    assert written == 1 and detached >= 1
    assert block.expert_kernels is None and torch.equal(block.w13, before)  # the others kept
    assert torch.equal(block.w2[1], new)


@pytest.mark.parametrize(
    "kind",
    [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K],
    ids=lambda kind: kind.name,
)
def test_the_integer_arithmetic_runs_the_types_that_have_it_in_integers(
    root: Path, wide_llama: Path, kind: GGMLQuantizationType
) -> None:
    from triode.gpu import gguf_kernels
    from triode.gpu.layers import LinearBase
    from triode.gpu.quant_matmul import GgufRows

    gguf = write_gguf(
        wide_llama, root / f"int8-{kind.name}.gguf", projection_type=kind, embedding_type=kind
    )
    converted = convert_gguf(gguf)
    options = {"dtype": "float32", "kv_cache_memory": 1 << 21, "max_model_len": 256}
    first: dict[str, list[Any]] = {}
    prompt = random.Random(kind.name).choices(range(3, 250), k=PROMPT_TOKENS)
    for mode in ("exact", "integer"):
        runner = ModelRunner(converted, gguf_arithmetic=mode, num_threads=1, **options)
        projections = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        for module in [*projections, runner.model.lm_head]:
            # Q4_0, Q4_1 and Q8_0 too: from the file's blocks, not repacked for the exact kernels
            repacked = kind in (T.Q4_0, T.Q4_1, T.Q8_0)
            assert isinstance(module.quant, GgufRows) == (mode == "integer" or not repacked)
            if mode == "integer":
                stored = module.stored
                # a merged projection's parts stay where they lie: a stack, no copy
                parts = stored.parts if isinstance(stored, GgufStack) else (stored,)
                assert module.quant.in_integers and all(isinstance(p, GgufWeight) for p in parts)
                x = torch.randn(3, parts[0].cols)
                want = [gguf_kernels.matmul_int8(x, p.data, kind, p.shape[0]) for p in parts]
                # the integer kernel, this very call
                assert torch.equal(module.quant(x), torch.cat(want, dim=1))
        d = Driver(runner)
        d.add("r", prompt)
        d.run(NEW_TOKENS)
        assert len(d.seqs["r"].output) == NEW_TOKENS
        first[mode] = d.seqs["r"].logprobs[:2]
    # the prompt's step and the first decode step (the C layer stack) ran in integers too: the
    # log-probabilities moved, by x's rounding alone (per 32 values against Q8_0, per 256
    # against the K-quants: 0.01-0.08 seen on this random model)
    for exact, integer in zip(first["exact"], first["integer"], strict=True):
        assert not np.array_equal(exact.logprobs, integer.logprobs)
        assert np.abs(exact.logprobs - integer.logprobs).max() < 0.15, kind.name


def test_the_quant_check_prints_the_integer_modes_agreement(
    root: Path, wide_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from triode.gpu.checks import quant

    gguf = write_gguf(wide_llama, root / "check-Q4_K.gguf", projection_type=T.Q4_K)
    assert quant.main([str(gguf), "--positions", "40"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    match = re.fullmatch(
        r".*: (\d+) projections in the integer mode; top token as the exact mode's at "
        r"(\d+)/(\d+) positions \(.*\), largest logprob difference ([\d.]+)",
        line,
    )
    assert match is not None, line
    taken, same, count, worst = match.groups()
    assert int(taken) > 0 and int(count) >= 40 and int(same) <= int(count)
    assert 0 < float(worst) < 1.0
    dense = write_gguf(
        wide_llama, root / "check-F16.gguf", projection_type=T.F16, embedding_type=T.F16
    )
    assert quant.main([str(dense), "--positions", "8"]) == 1  # no type of the integer mode
