"""`triode bench embed`: its workload, its options, the servers' command lines and the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from triode.edge.bench.embed import (
    MAX_WORDS,
    MIN_WORDS,
    corpus,
    parse_args,
    server_command,
    timed_requests,
    warmup_requests,
)
from triode.edge.bench.embed_report import (
    SENTENCE_TRANSFORMERS,
    TRIODE,
    VLLM,
    BatchRun,
    Contestant,
    agreement,
    format_table,
)


def test_the_corpus_is_the_same_for_a_seed_and_varies_in_length() -> None:
    sentences = corpus(500, 7)
    assert sentences == corpus(500, 7) and sentences != corpus(500, 8)
    lengths = [len(s.split()) for s in sentences]
    assert min(lengths) == MIN_WORDS and max(lengths) == MAX_WORDS
    assert all(s[0].isupper() and s.endswith(".") for s in sentences)


def test_each_batch_size_times_sentences_of_its_own() -> None:
    args = parse_args([])
    one, many = timed_requests(1, args), timed_requests(32, args)
    assert (len(one), {len(r) for r in one}) == (512, {1})
    assert (len(many), {len(r) for r in many}) == (64, {32})
    assert len(timed_requests(256, args)) == 8
    seen = {s for r in one for s in r}
    assert not seen & {s for r in many for s in r}
    warm = warmup_requests(256, args)
    assert len(warm) == args.concurrency and {len(r) for r in warm} == {32}
    assert [len(timed_requests(b, parse_args(["--requests", "3"]))) for b in (1, 32)] == [3, 3]


def test_options_are_checked() -> None:
    args = parse_args(["--batches", "1,16", "--no-vllm", "--model", "/m"])
    assert args.batch_list == [1, 16] and args.no_vllm and args.dtype == "float32"
    assert args.model == Path("/m") and args.requests is None and args.concurrency == 4
    for bad in (["--batches", "0"], ["--batches", "a"], ["--requests", "0"],
                ["--concurrency", "0"], ["--dtype", "float64"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_vllm_serves_the_model_as_a_pooling_model_in_the_dtype_asked() -> None:
    args = parse_args(["--vllm", "/v/python", "--model", "/m", "--dtype", "bfloat16"])
    command, env = server_command(VLLM, args.dtype, args, 8000)
    assert command[0] == "/v/python" and "/m" in command
    assert command[command.index("--runner") + 1] == "pooling"
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    command, env = server_command(TRIODE, "float32", args, 8000)
    assert "serve" in command and command[command.index("--dtype") + 1] == "float32"
    assert env == {}


def test_agreement_is_the_cosine_input_by_input() -> None:
    reference = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    low, mean = agreement(np.array([[2.0, 0.0], [1.0, 1.0]], np.float32), reference)
    assert low == pytest.approx(2**-0.5) and mean == pytest.approx((1 + 2**-0.5) / 2)
    with pytest.raises(ValueError):
        agreement(reference[:1], reference)


def _contestant(name: str, rates: dict[int, float], **fields: object) -> Contestant:
    runs = {b: BatchRun(b, 10, 100, 100 / rate, 1000.0 / rate) for b, rate in rates.items()}
    return Contestant(name, "float32", runs, **fields)  # type: ignore[arg-type]


def _rows(table: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]


def test_the_table_puts_triode_s_ratios_beside_their_targets() -> None:
    args = parse_args(["--batches", "1,32"])
    contestants = [
        _contestant(SENTENCE_TRANSFORMERS, {1: 50.0, 32: 200.0}),
        _contestant(TRIODE, {1: 80.0, 32: 150.0}, start_s=6.0, agreement=(0.99999, 1.0)),
        _contestant(VLLM, {1: 40.0, 32: 120.0}, start_s=90.0, agreement=(1.0, 1.0)),
    ]

    table = format_table(contestants, args, cpu="Some CPU, 2 CPUs", load=(0.1, 0.2))

    header = next(line for line in table.splitlines() if line.startswith("| b |"))
    assert "triode/vLLM (target >= 1.5x)" in header and "triode/ST (target >= 1.0x)" in header
    assert _rows(table) == [
        ["1", "50.0", "80.0", "40.0", "2.00x met", "1.60x met", "20.0", "12.5", "25.0"],
        ["32", "200.0", "150.0", "120.0", "1.25x below", "0.75x below", "5.0", "6.7", "8.3"],
    ]
    assert table.splitlines()[1].startswith("CPU: Some CPU, 2 CPUs")
    assert "triode min 0.999990 mean 1.000000; vLLM min 1.000000" in table
    assert "start to healthy: triode 6.0 s, vLLM 90.0 s" in table


def test_a_contestant_without_rows_gets_no_column_and_says_why() -> None:
    args = parse_args(["--batches", "1"])
    failed = BatchRun(1, 10, 90, 1.0, 20.0, failed=1, error="status 500: boom")
    contestants = [
        _contestant(SENTENCE_TRANSFORMERS, {1: 50.0}),
        Contestant(TRIODE, "float32", {1: failed}),
        Contestant(VLLM, "float32", note="skipped: --no-vllm"),
    ]

    table = format_table(contestants, args, cpu="c", load=(0.0, 0.0))

    assert _rows(table) == [["1", "50.0", "90.0 (1 failed)", "1.80x met", "20.0", "20.0"]]
    assert "vLLM: skipped: --no-vllm" in table
    assert "triode at b=1: 1 failed, first: status 500: boom" in table
