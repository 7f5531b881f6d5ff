"""The mixture-of-experts block benchmark: a short run on two gloo ranks checks every split's
output against one rank's and prints a row of timings per token count."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from triode.gpu.bench import moe as bench_moe

pytestmark = pytest.mark.slow


def test_a_short_run_times_every_split_at_each_token_count(
    own_children: Callable[[], list],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 3 tokens: the all_to_all dispatch's shares are uneven (2 + 1)
    assert bench_moe.main(["--tokens", "1", "3", "--rounds", "1", "--calls", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| tokens | TP=1 | TP=2 | EP allreduce | EP all_to_all |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(cell) > 0 for row in rows for cell in row[1:])
    assert own_children() == []
