"""The decode stack (`decode_stack.py`): a decode-only step's layers in one C call give every
row the modules' result bit for bit, and the steps and models it must not take go to the
modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runner_driver import Driver

from triode.gpu import cpu_kernels
from triode.gpu.decode_stack import DecodeStack
from triode.gpu.int4 import Int4Weight
from triode.gpu.lora.random_adapter import write_random_adapter
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import Logprobs

pytestmark = [
    pytest.mark.skipif(
        cpu_kernels.decode_stack() is None or cpu_kernels.quant_matmul() is None,
        reason="the CPU kernels are not built",
    ),
    # the stack runs `quant_matmul.c`'s projections: every CPU picks them as one without AMX
    # does, so the stack is checked on each
    pytest.mark.usefixtures("without_amx"),
]

Outputs = dict[str, tuple[list[int], list[list[list[float]]]]]


def _decode(
    runner: ModelRunner, prompts: list[list[int]], tokens: int, stacked: bool, lora_id: int = 0
) -> tuple[Outputs, int, int]:
    """Greedy outputs and logprobs of `prompts` (the last one joining after three steps, so one
    step holds a prompt beside decodes), with the decode stack on or off; and how many
    decode-only steps there were and how many of them the stack took."""
    model = runner.model.model
    stack = model.decode_stack
    assert stack is not None
    model.decode_stack = stack if stacked else None
    before = stack.steps
    driver = Driver(runner)
    tag = "stacked" if stacked else "modules"
    *first, late = prompts
    for i, prompt in enumerate(first):
        driver.add(f"{tag}-{i}", prompt, lora_id=lora_id)
    decode_only = 0
    try:
        while any(len(s.output) < tokens for s in driver.seqs.values()):
            if driver.step_count == 3:
                driver.add(f"{tag}-late", late, lora_id=lora_id)
            decode_only += all(len(s.tokens) - s.computed == 1 for s in driver.seqs.values())
            driver.step()
    finally:
        model.decode_stack = stack
    outputs = {
        request_id.split("-", 1)[1]: (seq.output[:tokens], [_values(lp) for lp in seq.logprobs])
        for request_id, seq in driver.seqs.items()
    }
    for request_id in outputs:
        driver.finish(f"{tag}-{request_id}")
    driver.step()  # the runner forgets them
    return outputs, decode_only, stack.steps - before


def _values(logprobs: Logprobs) -> list[list[float]]:
    parts = (logprobs.token_ids, logprobs.logprobs, logprobs.ranks)
    return [[float(v) for v in numbers.flatten()] for numbers in parts]


def _both_ways(
    runner: ModelRunner, prompts: list[list[int]], tokens: int, lora_id: int = 0
) -> tuple[int, int]:
    """Asserts that the stack on and off give the same outputs and logprobs, exactly; returns
    how many decode-only steps there were and how many the stack took."""
    ours, decode_only, taken = _decode(runner, prompts, tokens, True, lora_id)
    theirs, _, none = _decode(runner, prompts, tokens, False, lora_id)
    assert none == 0
    assert ours == theirs
    assert len(ours) == len(prompts)
    assert decode_only >= tokens - 4
    return decode_only, taken


def _runner(model_dir: Path, dtype: str, **options: Any) -> ModelRunner:
    return ModelRunner(
        model_dir, dtype=dtype, kv_cache_memory=32 << 20, max_model_len=256, num_threads=1,
        **options,
    )  # fmt: skip


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_decodes_through_the_stack_as_through_the_modules(
    smollm2: Path, dtype: str
) -> None:
    runner = _runner(smollm2, dtype)
    assert isinstance(runner.model.model.decode_stack, DecodeStack)
    # contexts of 1, 2 and 3 blocks, each row read to its own length; a prompt joins mid-way
    prompts = _prompts(runner.vocab_size, [3, 20, 40, 9])
    decode_only, taken = _both_ways(runner, prompts, tokens=10)
    assert taken == decode_only


def test_verify_rows_go_through_the_stack_as_through_the_modules(smollm2: Path) -> None:
    runner = _runner(smollm2, "float32")
    stack = runner.model.model.decode_stack
    assert stack is not None
    (prompt,) = _prompts(runner.vocab_size, [12])
    results, taken = [], []
    for stacked in (True, False):
        runner.model.model.decode_stack = stack if stacked else None
        before, tag = stack.steps, f"verify-{stacked}"
        driver = Driver(runner)
        driver.add(tag, prompt)
        driver.step()  # the prompt
        for _ in range(4):  # three proposals a step: the last token again
            driver.step(drafts={tag: [driver.seqs[tag].tokens[-1]] * 3})
        seq = driver.seqs[tag]
        results.append((seq.output, [_values(lp) for lp in seq.logprobs]))
        taken.append(stack.steps - before)
        driver.finish(tag)
        driver.step()
    runner.model.model.decode_stack = stack
    assert results[0] == results[1]
    assert taken == [4, 0]


def _int4(rows: int, cols: int, seed: int) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.05 + 0.01
    minimum = -8 * scale + torch.randn(rows, cols // 32, generator=g) * 0.01
    return Int4Weight(codes, scale.half().float(), minimum.half().float())


def _attach_random_4bit(runner: ModelRunner) -> int:
    """Every projection of a tiny model on random 4-bit weights of its shape."""
    config = runner.config
    head = config.hidden_size // config.num_attention_heads
    shapes = {
        "self_attn.q_proj": config.num_attention_heads * head,
        "self_attn.k_proj": config.num_key_value_heads * head,
        "self_attn.v_proj": config.num_key_value_heads * head,
        "self_attn.o_proj": config.hidden_size,
        "mlp.gate_proj": config.intermediate_size,
        "mlp.up_proj": config.intermediate_size,
        "mlp.down_proj": config.hidden_size,
    }
    weights = {}
    for layer in range(config.num_hidden_layers):
        for i, (name, rows) in enumerate(shapes.items()):
            cols = config.intermediate_size if name == "mlp.down_proj" else config.hidden_size
            weights[f"model.layers.{layer}.{name}.weight"] = _int4(rows, cols, 7 * layer + i)
    return runner.model.load_quantized_weights(weights)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (a bias on Q/K/V), its second layer attending to a sliding window of 8 tokens."""
    return build_tiny_model(
        tmp_path_factory.mktemp("stack") / "qwen2",
        architecture="qwen2",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_windowed_model_with_a_qkv_bias_decodes_through_the_stack_as_through_the_modules(
    windowed: Path, dtype: str
) -> None:
    runner = _runner(windowed, dtype)
    layers = runner.model.model.stage_layers
    assert [layer.self_attn.attn.window for layer in layers] == [None, 8]
    assert layers[0].self_attn.qkv_proj.bias is not None
    # dense weights: no projection on the 4-bit kernel, so the modules take every step
    prompts = _prompts(runner.vocab_size, [5, 19, 33, 12])
    assert _decode(runner, prompts, 6, True)[2] == 0
    assert _attach_random_4bit(runner) == 4 * len(layers)
    decode_only, taken = _both_ways(runner, prompts, tokens=12)
    assert taken == decode_only


def test_the_stack_follows_weight_changes_and_leaves_adapters_to_the_modules(
    windowed: Path, tmp_path: Path
) -> None:
    lora = {"max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8}
    runner = _runner(windowed, "float32", lora_config=lora)
    _attach_random_4bit(runner)
    prompts = _prompts(runner.vocab_size, [6, 21, 10])
    decode_only, taken = _both_ways(runner, prompts, tokens=6)
    assert taken == decode_only
    # one projection back on its dense weights: the plan it held is dropped, the modules run
    down = runner.model.model.stage_layers[1].mlp.down_proj
    assert down.detach_quantized()
    assert _decode(runner, prompts, 6, True)[2] == 0
    _attach_random_4bit(runner)
    decode_only, taken = _both_ways(runner, prompts, tokens=6)
    assert taken == decode_only
    # new bias values written in place (as a weight update writes them) reach the C side
    with torch.no_grad():
        for layer in runner.model.model.stage_layers:
            layer.self_attn.qkv_proj.bias.add_(torch.randn_like(layer.self_attn.qkv_proj.bias))
    decode_only, taken = _both_ways(runner, prompts, tokens=6)
    assert taken == decode_only
    # requests on an adapter: its deltas are added by the modules
    assert runner.lora is not None
    runner.lora.add(1, str(write_random_adapter(windowed, tmp_path / "adapter", rank=8, seed=3)))
    assert _both_ways(runner, prompts, tokens=6, lora_id=1)[1] == 0
