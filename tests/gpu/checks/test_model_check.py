"""`python -m triode.gpu.checks.model`: a model that cannot be served is named in one line from
its files alone (config.json, the safetensors and GGUF headers), without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from triode.gpu.checks.model import ModelProblem, check_model, main

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
}


def _tensors(layers: int = 2) -> dict[str, np.ndarray]:
    """A Llama checkpoint of `CONFIG`'s shapes (head_dim 4: q 8 rows, k and v 4)."""
    out = {"model.embed_tokens.weight": np.zeros((32, 8), np.float32)}
    out["model.norm.weight"] = np.zeros(8, np.float32)
    for i in range(layers):
        shapes = {
            "self_attn.q_proj.weight": (8, 8),
            "self_attn.k_proj.weight": (4, 8),
            "self_attn.v_proj.weight": (4, 8),
            "self_attn.o_proj.weight": (8, 8),
            "mlp.gate_proj.weight": (16, 8),
            "mlp.up_proj.weight": (16, 8),
            "mlp.down_proj.weight": (8, 16),
            "input_layernorm.weight": (8,),
            "post_attention_layernorm.weight": (8,),
        }
        for name, shape in shapes.items():
            out[f"model.layers.{i}.{name}"] = np.zeros(shape, np.float32)
    return out


def _model(
    path: Path, config: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None
) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    (path / "tokenizer.json").write_text("{}")
    save_file(_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    return path


def _problem(model: str, *flags: str) -> str:
    with pytest.raises(ModelProblem) as caught:
        check_model(model, *flags)
    return str(caught.value)


def test_a_model_that_fits_its_config_passes(tmp_path: Path) -> None:
    check_model(str(_model(tmp_path / "m")))


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    path = _model(tmp_path / "gpt2", {**CONFIG, "architectures": ["GPT2LMHeadModel"]})
    problem = _problem(str(path))
    assert "unsupported architecture GPT2LMHeadModel" in problem
    assert "Qwen3ForCausalLM" in problem and "\n" not in problem


def test_a_tensor_of_another_shape_than_the_config_says_is_named(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 8), np.float32)
    problem = _problem(str(_model(tmp_path / "m", tensors=tensors)))
    assert "tensor model.layers.1.self_attn.k_proj.weight has shape [8, 8]" in problem
    assert "config.json makes it [4, 8]" in problem


def test_more_or_fewer_layers_than_the_config_are_named(tmp_path: Path) -> None:
    problem = _problem(str(_model(tmp_path / "more", tensors=_tensors(layers=3))))
    assert "is of layer 2, but config.json has num_hidden_layers 2" in problem
    problem = _problem(str(_model(tmp_path / "fewer", tensors=_tensors(layers=1))))
    assert "no tensors for layer 1 of the 2 config.json has" in problem


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / "config.json").unlink(), "it has no config.json"),
        (lambda p: (p / "config.json").write_text("{"), "cannot be read as JSON"),
        (lambda p: (p / "tokenizer.json").unlink(), "has no tokenizer.json"),
        (lambda p: (p / "model.safetensors").unlink(), "has no *.safetensors weights"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\xff" * 16), "not a safetensors file"),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({k: v for k, v in CONFIG.items() if k != "vocab_size"})
            ),
            "no integer vocab_size",
        ),
    ],
)
def test_a_directory_that_is_not_a_whole_model_is_named(
    tmp_path: Path, damage: Any, problem: str
) -> None:
    path = _model(tmp_path / "m")
    damage(path)
    assert problem in _problem(str(path))


def test_a_missing_path_or_a_plain_file_is_named(tmp_path: Path) -> None:
    assert _problem(str(tmp_path / "nowhere")).endswith("no such file or directory")
    (tmp_path / "notes.txt").write_text("x")
    assert "not a model directory or a .gguf file" in _problem(str(tmp_path / "notes.txt"))


def _gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_token_list([f"t{i}" for i in range(1000)])  # an array before nothing else
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
def test_a_gguf_file_of_a_supported_family_passes_unconverted(
    tmp_path: Path, architecture: str
) -> None:
    check_model(str(_gguf(tmp_path / "m.gguf", architecture)))


def test_a_gguf_file_of_another_family_is_named(tmp_path: Path) -> None:
    problem = _problem(str(_gguf(tmp_path / "m.gguf", "gpt2")))
    assert "unsupported GGUF architecture gpt2" in problem
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + b"\0" * 40)
    assert "not a readable GGUF file" in _problem(str(tmp_path / "bad.gguf"))


def test_generation_config_flags_are_checked_with_the_model(tmp_path: Path) -> None:
    path = str(_model(tmp_path / "m"))
    assert "no generation_config.json there" in _problem(path, str(tmp_path))
    assert "unknown key 'temprature'" in _problem(path, "auto", '{"temprature": 0.5}')
    check_model(path, "vllm", '{"temperature": 0.5}')


def test_the_command_is_silent_when_fine_and_one_line_with_status_2_when_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(_model(tmp_path / "m"))]) == 0
    assert capsys.readouterr() == ("", "")
    assert main([str(tmp_path / "nowhere")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"{tmp_path / 'nowhere'}: no such file or directory\n"


def test_the_check_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, triode.gpu.checks.model; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy', 'gguf') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("head", "why"),
    [
        ((1 << 40).to_bytes(8, "little"), "not a safetensors file"),  # a terabyte's header
        ((64).to_bytes(8, "little") + b"{not json", "its header is not JSON"),
        (b"\x01", "not a safetensors file"),  # shorter than the length itself
    ],
)
def test_a_broken_safetensors_header_is_named_without_reading_past_it(
    tmp_path: Path, head: bytes, why: str
) -> None:
    model = _model(tmp_path / "m")
    (model / "model.safetensors").write_bytes(head)
    assert why in _problem(str(model))
