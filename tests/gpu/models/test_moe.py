"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers, and the grouped expert
computation against a per-token one."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from runner_driver import Driver, assert_greedy_as_transformers
from safetensors.torch import load_file

from triode.gpu.loader import transformers_directory
from triode.gpu.model_runner import ModelRunner
from triode.gpu.models.architectures import CheckpointMismatch
from triode.gpu.models.moe import Experts, SparseMoeBlock
from triode.gpu.models.qwen3_moe import sparse_layer
from triode.gpu.tiny_model import build_tiny_model

QWEN3_MOE = {
    "architecture": "qwen3_moe",
    "num_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [1],  # a dense MLP between two layers of experts
}
MODELS = {
    "qwen3-moe-norm": QWEN3_MOE | {"norm_topk_prob": True},
    "qwen3-moe-raw": QWEN3_MOE | {"norm_topk_prob": False, "seed": 1},
    # a window of 8 tokens, shorter than the 21-token prompt
    "mixtral": {
        "architecture": "mixtral",
        "num_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    },
}
PROMPT_TOKENS = 21
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: build_tiny_model(root / name, **spec) for name, spec in MODELS.items()}


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir, dtype="float32", kv_cache_memory=1 << 21, max_model_len=256, num_threads=1
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_match_transformers(models: dict[str, Path], name: str) -> None:
    from transformers import AutoModelForCausalLM

    prompt = random.Random(name).choices(range(3, 250), k=PROMPT_TOKENS)
    d = Driver(_runner(models[name]))
    d.add("r", prompt)
    d.run(NEW_TOKENS)
    seq = d.seqs["r"]
    hf = AutoModelForCausalLM.from_pretrained(
        transformers_directory(models[name]), dtype=torch.float32
    ).eval()
    assert_greedy_as_transformers(seq, hf, NEW_TOKENS)


def test_only_the_configured_layers_hold_experts(models: dict[str, Path]) -> None:
    layers = _runner(models["qwen3-moe-norm"]).model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]


# how many of the twelve experts tokens choose among (the even ones; the odd ones stay idle):
# half of them, one batched product per projection; a quarter, a product per expert
@pytest.mark.parametrize(("choosable", "batched"), [(6, True), (3, False)])
def test_grouped_experts_equal_each_token_through_its_own_experts(
    choosable: int, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    batch = Experts._batched
    monkeypatch.setattr(Experts, "_batched", lambda *a: calls.append(1) or batch(*a))
    torch.manual_seed(0)
    num_experts, hidden, intermediate, tokens, k = 12, 16, 12, 12, 2
    experts = Experts(num_experts, hidden, intermediate, expert_parallel=False)
    experts.w13.data.normal_()
    experts.w2.data.normal_()
    x = torch.randn(tokens, hidden)
    chosen = torch.stack([torch.randperm(choosable)[:k] * 2 for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    got = experts(x, weights, chosen)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = int(chosen[t, j])
            gate, up = (experts.w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (experts.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert bool(calls) == batched


def test_a_missing_or_unknown_expert_tensor_is_a_checkpoint_mismatch(
    models: dict[str, Path],
) -> None:
    model = _runner(models["mixtral"]).model
    weights = load_file(models["mixtral"] / "model.safetensors")
    assert model.load_weights(weights.items())  # the whole checkpoint loads
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    lacking = {n: t for n, t in weights.items() if n != name}
    with pytest.raises(CheckpointMismatch, match="experts"):
        model.load_weights(lacking.items())
    extra = weights | {name.replace("experts.2", "experts.4"): weights[name]}
    with pytest.raises(CheckpointMismatch, match=r"experts\.4"):
        model.load_weights(extra.items())


@pytest.mark.parametrize(
    ("step", "dense", "expected"),
    [
        (1, [], [True] * 4),
        (2, [], [False, True, False, True]),
        (1, [0, 3], [False, True, True, False]),
    ],
)
def test_qwen3_moe_layers_with_experts_follow_the_sparse_step_and_the_dense_list(
    step: int, dense: list[int], expected: list[bool]
) -> None:
    config = SimpleNamespace(num_experts=8, decoder_sparse_step=step, mlp_only_layers=dense)
    assert [sparse_layer(config, i) for i in range(4)] == expected


def test_four_bit_codes_of_experts_and_routers_are_left_alone(models: dict[str, Path]) -> None:
    # experts run dense (a GGUF's arrive dequantized); the router stays in the model's dtype
    model = _runner(models["qwen3-moe-norm"]).model
    prefix = "model.layers.0.mlp"
    names = [f"{prefix}.gate.weight"] + [
        f"{prefix}.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj")
    ]
    assert model.load_quantized_weights(dict.fromkeys(names)) == 0  # type: ignore[arg-type]
