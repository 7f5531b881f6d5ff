"""`triode bench step` on the tiny model: its table, and the arithmetic and the bytes it counts per
step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from triode.gpu.bench.step import flops_per_token


def test_flops_per_token_count_every_projection_the_head_and_attention() -> None:
    config = SimpleNamespace(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, vocab_size=10,
    )  # fmt: skip
    runner = SimpleNamespace(config=config)
    # per layer: qkv 8 x (8 + 4 + 4), o 8 x 8, gate, up and down 3 x 8 x 16
    weights = 2 * (8 * 16 + 8 * 8 + 3 * 8 * 16) + 10 * 8
    assert flops_per_token(runner, context=0) == 2 * weights  # type: ignore[arg-type]
    assert flops_per_token(runner, context=5) == 2 * weights + 2 * 4 * 5 * 8  # type: ignore[arg-type]


def test_a_short_run_prints_a_row_per_batch_size(tmp_path: Path) -> None:
    from triode.gpu.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "bench", "step", "--model", str(model),
         "--batch-sizes", "1,3", "--steps", "2", "--context", "20", "--profile", "2",
         "--max-model-len", "128"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]  # fmt: skip
    assert rows == ["1", "3"]
    assert "Self CPU" in done.stdout  # the profile's table


def test_with_adapters_each_batch_size_times_base_one_adapter_and_mixed(tmp_path: Path) -> None:
    from triode.gpu.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "bench", "step", "--model", str(model),
         "--batch-sizes", "1,4", "--steps", "2", "--context", "20", "--max-model-len", "128",
         "--lora", "2", "--lora-rank", "8", "--profile", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split("|") for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]  # fmt: skip
    assert [r[1].strip() for r in rows] == ["1", "4"]
    assert all(r[4].strip().endswith("x") and r[6].strip().endswith("x") for r in rows)
    assert "aten::addmm" in done.stdout  # the deltas in the mixed batch's profile


def test_a_step_reads_the_weights_as_the_kernels_hold_them_and_each_requests_kv(
    smollm2: Path,
) -> None:
    from triode.gpu.bench.step import step_bytes
    from triode.gpu.model_runner import ModelRunner

    options = {"kv_cache_memory": 16 << 20, "max_model_len": 128, "num_threads": 1}
    dense = ModelRunner(smollm2, dtype="float32", quantization="none", **options)
    stored = ModelRunner(smollm2, dtype="float32", **options)
    # 135 M float32 weights but the embedding (tied: read once, as the LM head)
    assert 500e6 < step_bytes(dense, 0, 0) < 545e6
    # 106 M weights in Q4_1 (20 bytes a block of 32), the head's 28 M in Q8_0 (34 bytes)
    projections, head = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576), 49152 * 576
    expected = projections * 20 / 32 + head * 34 / 32
    assert abs(step_bytes(stored, 0, 0) - expected) < 0.01 * expected
    # K and V of every layer for each cached token of each request: 3 heads of 64, float32
    kv = step_bytes(stored, 2, 10) - step_bytes(stored, 0, 0)
    assert kv == 2 * 10 * 30 * 2 * 3 * 64 * 4
