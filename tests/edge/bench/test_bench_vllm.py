"""`triode bench vllm`: the table with its ratios, the options, and a short triode-only run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from triode.edge.bench.vllm import command_for, format_table, parse_args


def _row(server: str, streams: int, throughput: float, ttft: float) -> dict[str, object]:
    return {"server": server, "concurrency": streams, "output_throughput": throughput,
            "median_ttft_ms": ttft, "median_tpot_ms": 1000.0 / throughput, "failed": 0,
            "start_s": 100.0 if server == "vllm" else 5.0}  # fmt: skip


def test_each_stream_count_puts_triode_beside_vllm_with_the_ratio() -> None:
    args = parse_args(["--vllm", "/v/python", "--concurrencies", "1,32"])
    rows = [_row("vllm", 1, 30.0, 50.0), _row("vllm", 32, 400.0, 600.0)]
    rows += [_row("triode", 1, 45.0, 40.0), _row("triode", 32, 520.0, 500.0)]

    table = format_table(rows, args)

    body = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and
            line[2].isdigit()]  # fmt: skip
    assert [(r[0].strip("| "), r[3]) for r in body] == [("1", "1.50x"), ("32", "1.30x")]
    assert [(r[4], r[5]) for r in body] == [("50", "40"), ("600", "500")]  # TTFT p50
    assert "start to healthy: vLLM 100 s, triode 5 s" in table


def test_options_are_checked_and_vllm_gets_the_machine_s_threads() -> None:
    args = parse_args(["--vllm", "/v/python", "--servers", "triode"])
    assert args.concurrency_list == [1, 8, 32, 64] and args.server_list == ["triode"]
    for bad in (["--concurrencies", "0,2"], ["--concurrencies", "a"], ["--servers", "tgi"]):
        with pytest.raises(SystemExit):
            parse_args(["--vllm", "/v/python", *bad])
    with pytest.raises(SystemExit):
        parse_args([])  # --vllm is required
    args.vllm_model = Path("/m")
    command, env = command_for("vllm", args, 8000)
    assert command[0] == "/v/python" and "/m" in command and "bfloat16" in command
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    command, env = command_for("triode", args, 8000)
    assert "serve" in command and env == {}


@pytest.mark.slow
def test_a_short_triode_run_prints_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "bench", "vllm", "--vllm", sys.executable,
         "--servers", "triode", "--model", "tiny-random", "--concurrencies", "1,2",
         "--output-len", "4", "--min-prompts", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"]) for r in rows] == [("triode", 1), ("triode", 2)]
    assert all(r["failed"] == 0 and r["output_throughput"] > 0 for r in rows)
