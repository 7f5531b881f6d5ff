"""`triode bench collectives`: two real gloo ranks produce every row, each with a time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from triode.edge.cli import BENCHMARKS
from triode.gpu.bench import collectives as bench_collectives

pytestmark = pytest.mark.slow


def _table_rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| operation | payload | p50 µs | p99 µs |"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_every_row_is_measured_with_positive_latencies(
    own_children: Callable[[], list], capsys: pytest.CaptureFixture[str]
) -> None:
    bench_collectives.main(["--iterations", "3"])
    out = capsys.readouterr().out

    assert out.startswith("CPU: ")
    rows = _table_rows(out)
    expected = [
        ("all_reduce", "[1, 576] float32"),
        ("all_reduce", "[64, 576] float32"),
        ("all_reduce", "[1, 576] bfloat16"),
        ("all_reduce", "[64, 576] bfloat16"),
        ("shm all_reduce", "[1, 576] float32"),
        ("shm all_reduce", "[64, 576] float32"),
        ("shm all_reduce", "[1, 576] bfloat16"),
        ("shm all_reduce", "[64, 576] bfloat16"),
        ("send/recv", "[1, 576] float32 hidden + float32 residual"),
        ("send/recv", "[64, 576] float32 hidden + float32 residual"),
        ("send/recv", "[1, 576] bfloat16 hidden + float32 residual"),
        ("send/recv", "[64, 576] bfloat16 hidden + float32 residual"),
        ("all_gather", "[1, 24576] float32 shard"),
        ("all_gather", "[64, 24576] float32 shard"),
        ("broadcast_object_list", "SchedulerOutput, 64 sequences"),
        ("ZMQ PUB/SUB", "SchedulerOutput, 64 sequences, msgpack"),
        (bench_collectives.SHM_RING_OP, "SchedulerOutput, 64 sequences, msgpack"),
    ]
    assert [(op, payload) for op, payload, _, _ in rows] == expected
    for op, payload, p50, p99 in rows:
        assert 0 < float(p50.replace(",", "")) <= float(p99.replace(",", "")), (op, payload)
    assert own_children() == []


def test_cli_names_the_benchmark() -> None:
    assert BENCHMARKS["collectives"].module == "triode.gpu.bench.collectives"
