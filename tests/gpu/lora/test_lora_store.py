"""Resident adapters outlive the model the runner rebuilds, and a step orders its rows so that
each adapter's rows are few runs, keeping the decode groups whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_builders import build_adapter, prompt, runner
from runner_driver import Driver

from triode.gpu.batch import decode_groups, flatten
from triode.gpu.lora import adapter_digest, lora_config_of
from triode.gpu.lora.punica import adapter_runs
from triode.gpu.operations import Operations
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import ScheduledRequest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora-store") / "tiny")


@pytest.fixture(scope="module")
def adapter(tiny: Path) -> Path:
    return build_adapter(
        tiny, tiny.parent / "adapter", seed=5, r=8, lora_alpha=16, target_modules="all-linear"
    )


def _generate(ops: Operations, lora_id: int) -> list[int]:
    d = Driver(ops.runner)
    d.add("r", prompt(19, seed=4), lora_id=lora_id)
    d.run(6)
    return d.seqs["r"].output


def test_adapters_survive_a_weights_sleep_and_load_while_asleep(tiny: Path, adapter: Path) -> None:
    ops = Operations(runner(tiny))
    result = ops.add_lora(1, str(adapter))
    assert result["digest"] == adapter_digest(adapter)
    assert result["targets"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # 2 layers of float32 pairs: a merged projection's A stacks its shards' and its B is
    # block-diagonal over its output
    qkv, o, gate_up, down = (
        64 * 24 + 24 * 128,
        64 * 8 + 8 * 64,
        64 * 16 + 16 * 256,
        128 * 8 + 8 * 64,
    )
    assert result["bytes"] == 2 * 4 * (qkv + o + gate_up + down)
    before = _generate(ops, 1)
    ops.sleep(["weights"])
    ops.add_lora(2, str(adapter))  # while the weights sleep
    ops.wake_up(["weights"])
    assert _generate(ops, 1) == before
    assert _generate(ops, 2) == before
    ops.update_weights_from_disk(str(tiny))  # in place: the same projections
    assert _generate(ops, 1) == before


def _decode(rid: str, context: int) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], context, list(range(-(-(context + 1) // 4))))


def test_decodes_sort_by_block_bucket_then_adapter_and_runs_merge() -> None:
    lora = {"a": 2, "b": 0, "c": 2, "d": 1, "e": 2, "f": 1, "p": 2, "q": 0}
    contexts = {"a": 3, "b": 2, "c": 1, "d": 0, "e": 30, "f": 29}
    requests = [_decode(rid, ctx) for rid, ctx in contexts.items()]
    requests += [
        ScheduledRequest("p", [5, 6, 7], 0, [20]),
        ScheduledRequest("q", [5, 6], 0, [21]),
    ]
    batch = flatten(
        requests,
        block_size=4,
        device=torch.device("cpu"),
        dtype=torch.float32,
        paged_kernel=False,
        embeds_of=None,
        lora_of=lambda r: lora[r.request_id],
    )
    order = sorted(batch.start, key=batch.start.__getitem__)
    # one block: base, adapter 1, adapter 2 (shortest first); 8 blocks: 1, 2; then the chunks
    assert order == ["b", "d", "c", "a", "f", "e", "q", "p"]
    assert batch.lora_runs == [(1, 2, 1), (2, 4, 2), (4, 5, 1), (5, 6, 2), (8, 11, 2)]
    assert [(g.start, len(g.context_lens)) for g in batch.meta.decodes] == [(0, 4), (4, 2)]
    assert decode_groups([1, 1, 1, 1, 8, 8]) == [(0, 4), (4, 6)]


def test_adjacent_requests_of_one_adapter_merge_into_one_run() -> None:
    assert adapter_runs([(1, 3), (2, 3), (4, 0), (1, 3), (2, 5)]) == [
        (0, 3, 3),
        (7, 8, 3),
        (8, 10, 5),
    ]
    assert adapter_runs([(5, 0)]) == []


def test_engine_arguments_without_enable_lora_mean_no_lora() -> None:
    assert lora_config_of({"model": "x"}) is None
    assert lora_config_of({"enable_lora": False, "max_loras": 3}) is None
    assert lora_config_of({"enable_lora": True, "max_loras": 3, "max_lora_rank": 64}) == {
        "max_loras": 3,
        "max_lora_rank": 64,
        "max_cpu_loras": None,
        "lora_dtype": "auto",
    }


def test_adapters_kept_in_bfloat16_on_a_float32_model_give_its_deltas_rounded(
    tiny: Path, adapter: Path
) -> None:
    """`--lora-dtype bfloat16` halves an adapter's bytes on a float32 model: its pairs are kept
    and multiplied in bfloat16, so the adapter moves the logprobs as it does in float32 up to
    bfloat16's rounding, and the base model's rows not at all."""
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        ops = Operations(runner(tiny, {"lora_dtype": dtype}))
        result = ops.add_lora(1, str(adapter))
        pair = ops.runner.lora.adapters[1].modules["model.layers.0.mlp.down_proj"]  # type: ignore[union-attr]
        assert pair.a_t.dtype == getattr(torch, dtype)
        d = Driver(ops.runner)
        for lora_id in (0, 1):
            d.add(f"r{lora_id}", prompt(19, seed=4), lora_id=lora_id)
        d.run(1)
        logprobs[dtype] = {r: s.logprobs[0].logprobs[0] for r, s in d.seqs.items()}
        logprobs[dtype]["bytes"] = result["bytes"]
    full, half = logprobs["float32"], logprobs["bfloat16"]
    assert half["bytes"] * 2 == full["bytes"]
    assert abs(half["r0"] - full["r0"]).max() == 0  # the base model's rows: untouched
    moved = abs(full["r1"] - full["r0"]).max()  # what the adapter does to them
    assert moved > 0.02
    # bfloat16's 8 bits of mantissa on the delta: measured 0.008 of 0.058
    assert abs(half["r1"] - full["r1"]).max() < moved / 4
