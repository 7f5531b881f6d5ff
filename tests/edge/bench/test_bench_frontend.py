"""`triode bench frontend`: the vLLM-shaped model, the table, and a short run end to end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from triode.edge.bench.frontend import format_table, parse_args, vllm_shaped


def test_the_vllm_shaped_model_has_wider_heads_and_the_same_weights(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 259}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"weights")

    shaped = vllm_shaped(model, tmp_path / "shaped")

    got = json.loads((shaped / "config.json").read_text())
    assert (got["num_attention_heads"], got["num_key_value_heads"], got["head_dim"]) == (2, 1, 32)
    # the projections keep their shapes: heads x head_dim is unchanged for q and for k, v
    assert got["num_attention_heads"] * got["head_dim"] == 4 * 16
    assert got["num_key_value_heads"] * got["head_dim"] == 2 * 16
    assert (shaped / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model / "config.json").read_text()) == config  # the original is kept


def _row(server: str, count: int, throughput: float) -> dict[str, object]:
    return {"server": server, "api_servers": count, "output_throughput": throughput,
            "median_ttft_ms": 40.0, "edge_cpu_s": 2.0 * count, "engine_cpu_s": 1.0,
            "client_cpu_s": 3.0, "output_tokens_per_edge_cpu_s": 1000.0, "failed": 0}  # fmt: skip


def test_each_triode_row_stands_beside_vllm_s_with_the_same_count() -> None:
    args = argparse.Namespace(model="/x/tiny", num_prompts=8, output_len=4, max_concurrency=2)
    rows = [_row("vllm", 1, 1000.0), _row("vllm", 2, 500.0)]
    rows += [_row("triode", 1, 1500.0), _row("triode", 2, 2000.0)]

    table = format_table(rows, args).splitlines()

    body = [
        line.split(" | ")
        for line in table
        if line.startswith("| vllm") or line.startswith("| triode")
    ]
    assert [(r[1], r[3], r[4]) for r in body] == [
        ("1", "1.00x", ""), ("2", "0.50x", ""), ("1", "1.00x", "1.50x"), ("2", "1.33x", "4.00x"),
    ]  # fmt: skip
    assert [r[7] for r in body] == ["2.0", "2.0", "2.0", "2.0"]  # edge CPU per API server


def test_api_server_counts_are_checked() -> None:
    assert parse_args(["--api-server-counts", "1,4"]).counts == [1, 4]
    with pytest.raises(SystemExit):
        parse_args(["--api-server-counts", "0,2"])


@pytest.mark.slow
def test_a_short_run_of_two_api_servers_prints_its_row() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "bench", "frontend", "--num-prompts", "8",
         "--max-concurrency", "4", "--output-len", "4", "--api-server-counts", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| triode")]
    assert [r[1] for r in rows] == ["2"]
    assert all(r[-1].strip(" |") == "0" for r in rows)  # no request failed
    assert all(float(r[2].replace(",", "")) > 0 for r in rows)
