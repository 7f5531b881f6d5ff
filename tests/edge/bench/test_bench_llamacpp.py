"""`triode bench llamacpp`: the commands, the counted stream, the table with its medians and
ratios, the options, and a short run against both real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from triode.edge.bench.completion_stream import RequestResult, stream_completion
from triode.edge.bench.llamacpp import (
    command_for,
    format_table,
    llamacpp_body,
    parse_args,
    triode_paths,
)

LLAMACPP_ARGS = ["--llamacpp", "/v/python", "--model", "/m/model.gguf"]


def _row(server: str, streams: int, round_: int, throughput: float, ttft: float) -> dict[str, Any]:
    return {"server": server, "concurrency": streams, "round": round_,
            "output_throughput": throughput, "median_ttft_ms": ttft,
            "median_tpot_ms": 1000.0 / throughput, "failed": 0, "completed": 4,
            "total_output_tokens": 4 * 128,
            "start_s": 3.0 if server == "llamacpp" else 20.0}  # fmt: skip


def _body(table: str) -> list[list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]


def test_each_stream_count_puts_triode_beside_llamacpp_with_the_ratios() -> None:
    args = parse_args([*LLAMACPP_ARGS, "--concurrencies", "1,8"])
    rows = [_row("llamacpp", 1, 0, 100.0, 20.0), _row("llamacpp", 8, 0, 100.0, 4000.0)]
    rows += [_row("triode", 1, 0, 50.0, 40.0), _row("triode", 8, 0, 400.0, 200.0)]

    table = format_table(rows, args)

    body = _body(table)
    assert [(r[0], r[1], r[2], r[3]) for r in body] == [
        ("1", "100.0", "50.0", "0.50x"),
        ("8", "100.0", "400.0", "4.00x"),
    ]
    assert [(r[7], r[8], r[9]) for r in body] == [("20", "40", "2.00x"), ("4,000", "200", "0.05x")]
    assert [(r[10], r[11], r[12]) for r in body] == [
        ("10.0", "20.0", "0/0"),
        ("10.0", "2.5", "0/0"),
    ]
    assert "llama.cpp: 128.0, 128.0 tokens per request, start to ready 3 s" in table
    assert "triode: 128.0, 128.0 tokens per request, start to ready 20 s" in table


def test_rounds_give_median_figures_and_the_median_of_the_rounds_ratios() -> None:
    args = parse_args([*LLAMACPP_ARGS, "--concurrencies", "1", "--rounds", "3"])
    # the machine slows down in round 1: both servers alike, so the ratio stays
    speeds = [(100.0, 150.0), (50.0, 75.0), (90.0, 135.0)]
    rows = [_row(server, 1, i, speed, 10.0) for i, pair in enumerate(speeds)
            for server, speed in zip(("llamacpp", "triode"), pair, strict=True)]  # fmt: skip

    [row] = _body(format_table(rows, args))

    assert (row[1], row[2], row[3]) == ("90.0", "135.0", "1.50x")
    assert "medians of 3 round(s)" in format_table(rows, args)


def test_a_concurrency_without_both_servers_has_no_row() -> None:
    args = parse_args([*LLAMACPP_ARGS, "--concurrencies", "1,8"])
    rows = [_row("llamacpp", 1, 0, 100.0, 20.0), _row("triode", 1, 0, 50.0, 40.0)]
    rows.append(_row("llamacpp", 8, 0, 100.0, 20.0))
    assert [r[0] for r in _body(format_table(rows, args))] == ["1"]


def _flags(command: list[str]) -> dict[str, str]:
    """The `--flag value` pairs after llama.cpp's `PYTHON -c CODE`."""
    return dict(zip(command[3::2], command[4::2], strict=True))


def test_options_are_checked_and_llamacpp_gets_the_machine_s_threads() -> None:
    args = parse_args(LLAMACPP_ARGS)
    assert args.concurrency_list == [1, 8] and args.rounds == 1 and args.output_len == 128
    bad_options = (["--concurrencies", "0,2"], ["--concurrencies", "a"], ["--rounds", "0"],
                   ["--llamacpp-threads", "0"])  # fmt: skip
    for bad in bad_options:
        with pytest.raises(SystemExit):
            parse_args([*LLAMACPP_ARGS, *bad])

    command = command_for("llamacpp", args, 8000)
    assert command[:2] == ["/v/python", "-c"] and "llama_cpp.server" in command[2]
    flags = _flags(command)
    threads = str(len(os.sched_getaffinity(0)))
    assert flags["--model"] == "/m/model.gguf" and flags["--port"] == "8000"
    assert flags["--n_threads"] == flags["--n_threads_batch"] == threads
    assert flags["--interrupt_requests"] == "False"
    one_thread = parse_args([*LLAMACPP_ARGS, "--llamacpp-threads", "1"])
    flags = _flags(command_for("llamacpp", one_thread, 8000))
    assert flags["--n_threads"] == flags["--n_threads_batch"] == "1"
    command = command_for("triode", args, 8000)
    assert "serve" in command and "/m/model.gguf" in command


def test_the_defaults_are_triode_s_cache_and_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIODE_CACHE", str(tmp_path))
    args = parse_args([])
    assert args.llamacpp == str(tmp_path / "llamacpp-venv" / "bin" / "python")
    assert args.model.parent == tmp_path / "models" and args.model.suffix == ".gguf"


def test_the_llamacpp_request_asks_for_exactly_the_output_length_greedily() -> None:
    body = llamacpp_body("m", "hello", 16)
    assert body["max_tokens"] == body["min_tokens"] == 16
    assert body["temperature"] == 0 and body["repeat_penalty"] == 1.0 and body["stream"]


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def _stream(content: bytes) -> RequestResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await stream_completion(client, {"prompt": "p"}, counted=True)


async def test_a_stream_without_usage_counts_one_token_per_chunk_before_the_end() -> None:
    # llama-cpp-python's stream: a chunk per token, then an empty one that finishes
    body = (
        _sse(_chunk(" a"), _chunk(" b"), _chunk(" c"), _chunk("", "length")) + b"data: [DONE]\n\n"
    )
    result = await _stream(body)
    assert result.ok and result.output_tokens == 3
    assert 0 < result.ttft <= result.latency


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (_sse(_chunk("", "stop")) + b"data: [DONE]\n\n", "the stream carried no completion tokens"),
        (_sse(_chunk(" a"), _chunk("", "length")), "the stream ended without [DONE]"),
    ],
)
async def test_a_stream_without_tokens_or_end_fails(content: bytes, error: str) -> None:
    result = await _stream(content)
    assert not result.ok and result.error == error


def _llamacpp_python() -> Path:
    return triode_paths()[0] / "llamacpp-venv" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(
    not _llamacpp_python().is_file(),
    reason="no llama-cpp-python[server] in $TRIODE_CACHE/llamacpp-venv (make bench-llamacpp)",
)
def test_a_short_run_measures_both_servers_on_equal_tokens(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.bench.llamacpp", "--concurrencies", "1",
         "--output-len", "4", "--min-prompts", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"]) for r in rows] == [("llamacpp", 1), ("triode", 1)]
    assert all(r["failed"] == 0 and r["output_throughput"] > 0 for r in rows)
    assert [r["total_output_tokens"] for r in rows] == [2 * 4, 2 * 4]
    assert "| 1 |" in done.stdout
