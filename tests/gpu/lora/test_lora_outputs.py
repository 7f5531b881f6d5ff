"""LoRA adapters on the model runner against transformers + peft, float32: each adapter alone,
several mixed with base-model requests in one batch (prefill, chunked prefill and decodes),
the same tokens and log-probabilities within 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_builders import (
    build_adapter,
    hf_model,
    our_logprobs,
    prompt,
    reference_generate,
    reference_logprobs,
    runner,
)
from runner_driver import Driver, Seq

from triode.gpu.attention import AttentionMetadata, PrefillChunk
from triode.gpu.operations import Operations
from triode.gpu.tiny_model import build_tiny_model

ADAPTERS = {
    "all-seven-r8": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "q-v-r16": {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
    "rslora-r16": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear", "use_rslora": True},
    "mlp-regex-r8": {"r": 8, "lora_alpha": 8, "target_modules": r".*\.mlp\.(gate|down)_proj"},
    "patterns-r8": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": "all-linear",
        "rank_pattern": {"q_proj": 4, "layers.1.mlp.up_proj": 2},
        "alpha_pattern": {"down_proj": 4},
    },
}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def models(root: Path) -> dict[str, Path]:
    return {
        "llama": build_tiny_model(root / "llama"),
        "qwen2": build_tiny_model(root / "qwen2", architecture="qwen2"),
    }


@pytest.fixture(scope="module")
def adapters(root: Path, models: dict[str, Path]) -> dict[tuple[str, str], Path]:
    built = {}
    for model, path in models.items():
        for i, (name, options) in enumerate(ADAPTERS.items()):
            built[model, name] = build_adapter(path, root / f"{model}-{name}", seed=i, **options)
    return built


def _assert_matches_reference(model_dir: Path, adapter: Path | None, seq: Seq) -> None:
    prompt_ids = seq.tokens[: seq.prompt_len]
    assert seq.output == reference_generate(model_dir, adapter, prompt_ids, len(seq.output))
    expected = reference_logprobs(model_dir, adapter, seq)
    torch.testing.assert_close(our_logprobs(seq), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_each_adapter_alone_matches_peft(
    models: dict[str, Path], adapters: dict, model: str, adapter: str
) -> None:
    model_dir, path = models[model], adapters[model, adapter]
    r = runner(model_dir)
    result = Operations(r).add_lora(1, str(path))
    assert result["rank"] == ADAPTERS[adapter]["r"]
    d = Driver(r)
    d.add("with", prompt(23, seed=1), lora_id=1)
    d.add("without", prompt(23, seed=1))
    d.run(NEW_TOKENS)
    _assert_matches_reference(model_dir, path, d.seqs["with"])
    _assert_matches_reference(model_dir, None, d.seqs["without"])
    assert d.seqs["with"].output != d.seqs["without"].output  # the adapter does something


def test_adapters_mixed_with_base_requests_in_one_batch_match_each_alone(
    models: dict[str, Path], adapters: dict
) -> None:
    model_dir = models["llama"]
    r = runner(model_dir)
    ops = Operations(r)
    names = ["all-seven-r8", "q-v-r16", "rslora-r16", "patterns-r8"]
    for lora_id, name in enumerate(names, start=1):
        ops.add_lora(lora_id, str(adapters["llama", name]))
    d = Driver(r)
    # the base model between adapters, two requests of one adapter, one prompt in chunks
    plan = [("a", 1), ("base1", 0), ("b", 2), ("c", 3), ("a2", 1), ("base2", 0), ("d", 4)]
    for i, (request_id, lora_id) in enumerate(plan):
        d.add(request_id, prompt(9 + 5 * i, seed=i), lora_id=lora_id)
    d.run(NEW_TOKENS, chunks={"c": 7, "a2": 11})
    for request_id, lora_id in plan:
        adapter = adapters["llama", names[lora_id - 1]] if lora_id else None
        _assert_matches_reference(model_dir, adapter, d.seqs[request_id])


def test_prompt_logits_of_a_mixed_prefill_match_peft(
    models: dict[str, Path], adapters: dict
) -> None:
    """Rows of three requests (adapter 1, base, adapter 2) in one forward, each request's
    logits against peft's for it alone."""
    model_dir = models["qwen2"]
    r = runner(model_dir)
    ops = Operations(r)
    paths = [adapters["qwen2", "all-seven-r8"], adapters["qwen2", "q-v-r16"]]
    for lora_id, path in enumerate(paths, start=1):
        ops.add_lora(lora_id, str(path))
    prompts = [(prompt(17, 1), 1), (prompt(12, 2), 0), (prompt(20, 3), 2)]
    ids = torch.tensor([t for p, _ in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p, _ in prompts])
    chunks, runs, start, block = [], [], 0, 0
    for p, lora_id in prompts:
        blocks = -(-len(p) // r.block_size)
        chunks.append(PrefillChunk.build(start, len(p), 0, torch.arange(block, block + blocks)))
        if lora_id:
            runs.append((start, start + len(p), lora_id))
        start, block = start + len(p), block + blocks
    slots = torch.cat(
        [c.block_table[:1] * r.block_size + torch.arange(c.num_tokens) for c in chunks]
    )
    meta = AttentionMetadata(slots, 0, (), tuple(chunks))
    assert r.lora is not None
    r.lora.start_step(runs)
    with torch.inference_mode():
        ours = r.model.compute_logits(r.model(ids, positions, meta))
    start = 0
    from peft import PeftModel

    for p, lora_id in prompts:
        model = hf_model(model_dir)
        if lora_id:
            model = PeftModel.from_pretrained(model, paths[lora_id - 1]).eval()
        with torch.inference_mode():
            theirs = model(input_ids=torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours[start : start + len(p)], theirs, atol=1e-4, rtol=1e-4)
        start += len(p)
