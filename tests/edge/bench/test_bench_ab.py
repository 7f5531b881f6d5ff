"""`triode bench ab`'s parts that need no server: a baseline checkout's packages shadow this
tree's for a child process, and the comparison of rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from triode.edge.bench.ab import (
    check_source,
    compare,
    format_rows,
    imported_from,
    link_packages,
    parse_args,
    side_envs,
)

HERE = Path(__file__).resolve().parents[3]


def _checkout(root: Path) -> Path:
    for package in ("wire", "actors", "edge", "gpu"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "edge" / "cli.py").write_text("")
    return root


def test_a_baseline_checkout_shadows_this_tree_in_a_child_only(tmp_path: Path) -> None:
    baseline = _checkout(tmp_path / "base")
    envs = side_envs(link_packages(baseline, tmp_path / "links"))

    assert [p.resolve() for p in imported_from(envs["baseline"])] == [
        baseline / "edge" / "cli.py",
        baseline / "wire" / "__init__.py",
    ]
    check_source(envs["baseline"], baseline)
    check_source(envs["current"], HERE)
    with pytest.raises(RuntimeError, match="not a module under"):
        check_source(envs["current"], baseline)


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wire").mkdir()
    with pytest.raises(ValueError, match="not a triode checkout: no wire, actors, edge"):
        link_packages(tmp_path, tmp_path / "links")


def _result(tok_s: float, ttft: float = 10.0) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "failed": 0}


def test_rounds_compare_by_their_medians_with_each_sides_spread_as_noise() -> None:
    rounds = {
        "baseline": {1: [_result(100), _result(110), _result(90)], 32: [_result(1000)] * 3},
        "current": {1: [_result(99), _result(101), _result(100)], 32: [_result(950)] * 3},
    }

    [one, many] = compare(rounds)

    assert (one["baseline_tok_s"], one["current_tok_s"]) == (100, 100)
    assert one["baseline_noise_pct"] == pytest.approx(20) and one["change_pct"] == 0
    assert one["current_noise_pct"] == pytest.approx(2)
    assert many["change_pct"] == pytest.approx(-5) and many["current_noise_pct"] == 0
    table = format_rows([one, many], 3)
    assert "-5.0%" in table and "median of 3 rounds" in table


def test_the_defaults_measure_1_and_32_streams_over_3_rounds() -> None:
    args = parse_args(["--baseline", "/tmp/base"])
    assert (args.concurrency, args.rounds) == ([1, 32], 3)
    with pytest.raises(SystemExit):
        parse_args(["--baseline", "/tmp/base", "--concurrency", "0"])
