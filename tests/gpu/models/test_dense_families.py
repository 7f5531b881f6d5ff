"""The dense families against transformers: tiny random-weight Qwen3, Gemma 3, Mistral and Qwen2
checkpoints, each with a sliding window shorter than the prompts, give transformers' greedy
tokens and its logprobs (float32)."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from runner_driver import Driver, assert_greedy_as_transformers

from triode.gpu.attention import AttentionMetadata, PrefillChunk
from triode.gpu.loader import transformers_directory
from triode.gpu.model_runner import ModelRunner
from triode.gpu.models.architectures import UnsupportedArchitecture
from triode.gpu.models.gemma3 import check_config, layer_type_rope
from triode.gpu.tiny_model import build_tiny_model

WINDOW = 8
SHAPE: dict[str, Any] = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architecture": "qwen3",
        "num_layers": 3,
        "head_dim": 16,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,  # layers 1 and 2 slide, layer 0 sees everything
    },
    "gemma3": {
        "architecture": "gemma3",
        "num_layers": 4,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    },
    "mistral": {"architecture": "llama", "num_layers": 3},  # given a window in config.json
    "qwen2": {
        "architecture": "qwen2",
        "num_layers": 3,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
    },
}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


@functools.cache
def _model(tmp_root: Path, family: str) -> Path:
    path = build_tiny_model(tmp_root / family, **SHAPE, **FAMILIES[family])
    if family == "mistral":  # Mistral is Llama's checkpoint layout with a sliding window
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config |= {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "sliding_window": WINDOW,
        }
        config_file.write_text(json.dumps(config))
    return path


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir, dtype="float32", kv_cache_memory=1 << 21, max_model_len=256, num_threads=1
    )


def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).choices(range(3, 250), k=n)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_logits_match_transformers_past_the_window(tmp_root: Path, family: str) -> None:
    model_dir = _model(tmp_root, family)
    runner = _runner(model_dir)
    prompt = _prompt(3 * WINDOW + 5)
    n = len(prompt)
    table = torch.arange(-(-n // runner.block_size))
    meta = AttentionMetadata(torch.arange(n), 0, (), (PrefillChunk.build(0, n, 0, table),))
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(torch.tensor(prompt), torch.arange(n), meta)
        )
        theirs = _hf(model_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_and_logprobs_match_transformers_generate(
    tmp_root: Path, family: str
) -> None:
    model_dir = _model(tmp_root, family)
    prompt, steps = _prompt(2 * WINDOW + 3, seed=1), 12
    driver = Driver(_runner(model_dir))
    driver.add("r", prompt)
    driver.run(steps)
    assert_greedy_as_transformers(driver.seqs["r"], _hf(model_dir), steps)


def test_gemma3_softcapped_logits_stay_within_the_cap(tmp_root: Path) -> None:
    runner = _runner(_model(tmp_root, "gemma3"))
    with torch.inference_mode():
        logits = runner.model.compute_logits(torch.randn(4, SHAPE["hidden_size"]) * 100)
    assert logits is not None and logits.abs().max() <= 3.0


@pytest.mark.parametrize(
    "setting",
    [
        {"attn_logit_softcapping": 50.0},
        {"use_bidirectional_attention": True},
        {"hidden_activation": "gelu"},
    ],
)
def test_gemma3_refuses_what_it_does_not_compute(setting: dict[str, Any]) -> None:
    from transformers import Gemma3TextConfig

    with pytest.raises(UnsupportedArchitecture, match=next(iter(setting))):
        check_config(Gemma3TextConfig(**setting))


def test_gemma3_rope_per_layer_type_from_either_config_layout() -> None:
    from transformers import Gemma3TextConfig

    linear = {"rope_type": "linear", "factor": 8.0}
    older = SimpleNamespace(rope_local_base_freq=10_000.0, rope_theta=1e6, rope_scaling=linear)
    assert layer_type_rope(older, "sliding_attention") == (10_000.0, None)
    assert layer_type_rope(older, "full_attention") == (1e6, linear)
    # transformers >= 5 reads the older fields into `rope_parameters`, keyed by layer type
    newer = Gemma3TextConfig(rope_local_base_freq=20_000.0, rope_theta=1e6, rope_scaling=linear)
    theta, scaling = layer_type_rope(newer, "sliding_attention")
    assert theta == 20_000.0 and scaling is not None and scaling["rope_type"] == "default"
    theta, scaling = layer_type_rope(newer, "full_attention")
    assert theta == 1e6 and scaling is not None and scaling["factor"] == 8.0
