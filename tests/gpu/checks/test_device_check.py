"""The device check's collectives on real gloo ranks, its rank harness, its no-GPU answer, and
its parallel model checks on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from triode.gpu.checks.collective import check_collectives
from triode.gpu.checks.parallel import MAX_TOKENS, Decoded, compare
from triode.gpu.local_group import Rank, RankError, run_ranks
from triode.gpu.tiny_model import build_uneven_tiny_model

pytestmark = pytest.mark.slow

HIDDEN_64 = 576 * 64


def test_gloo_collectives_at_world_2_match_their_exact_expected_values(
    own_children: Callable[[], list],
) -> None:
    rows = check_collectives("gloo", 2, iterations=5)

    all_reduces = {
        ("all_reduce", dtype, n)
        for dtype in ("float32", "bfloat16")
        for n in (576, HIDDEN_64, 1 << 20)
    }
    others = {(op, "float32", HIDDEN_64) for op in ("all_gather", "broadcast", "send/recv ring")}
    assert {(r.op, r.dtype, r.numel) for r in rows} == all_reduces | others
    assert [(r.op, r.note) for r in rows if r.status != "pass"] == []
    assert all(r.backend == "gloo" and r.world == 2 for r in rows)
    assert all(r.latency_us is not None and r.latency_us > 0 for r in rows)
    assert own_children() == []


def _fail_on_rank_1(me: Rank) -> None:
    if me.rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()  # waits for a rank that never comes


def test_a_failing_rank_is_raised_and_no_rank_outlives_it(own_children: Callable[[], list]) -> None:
    with pytest.raises(RankError, match="rank 1 gives up") as caught:
        run_ranks(_fail_on_rank_1, backend="gloo", world=2, timeout=60)
    assert "RuntimeError: rank 1 gives up" in caught.value.tracebacks[1]
    assert own_children() == []


def _sleep(me: Rank) -> None:
    time.sleep(600)


def test_ranks_past_the_timeout_are_killed(own_children: Callable[[], list]) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_ranks(_sleep, backend="gloo", world=2, timeout=5)
    assert time.monotonic() - start < 30
    assert own_children() == []


def _device_check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    return subprocess.run(
        [sys.executable, "-m", "triode.gpu.checks.device", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_device_check_without_a_gpu_says_so_and_exits_0() -> None:
    result = _device_check()
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU present" in result.stdout


def test_device_check_requiring_a_gpu_exits_2_without_one() -> None:
    result = _device_check("--require-gpu")
    assert result.returncode == 2, result.stderr
    assert "no CUDA GPU present" in result.stdout


def test_device_check_on_cpu_passes_every_parallel_world_of_a_tiny_model(tmp_path: Path) -> None:
    tiny = build_uneven_tiny_model(tmp_path / "tiny")
    # six worlds: TP=1, TP=2, PP=2, TP=2xPP=2, and a tiny MoE's TP=1 and TP=2+EP
    result = _device_check("--cpu", "--model", str(tiny), timeout=400)

    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| greedy")]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [
        ("| greedy TP=2 vs TP=1", "gloo", "2", "pass"),
        ("| greedy PP=2 vs TP=1", "gloo", "2", "pass"),
        ("| greedy TP=2xPP=2 vs TP=1", "gloo", "4", "pass"),
        ("| greedy TP=2+EP vs TP=1", "gloo", "2", "pass"),
    ], result.stdout + result.stderr
    assert result.returncode == 0


def test_a_parting_token_or_a_distant_logprob_fails_the_comparison() -> None:
    rows = np.zeros((MAX_TOKENS, 21), dtype=np.float32)
    want = Decoded([list(range(MAX_TOKENS))] * 2, [rows, rows])

    assert compare(want, want)[0] == "pass"
    parted = Decoded([want.tokens[0], [*want.tokens[1][:-1], -1]], want.logprobs)
    status, note = compare(parted, want)
    assert status == "FAIL" and "prompt 1 parts at token 23" in note
    for off in (2e-4, np.nan):
        drifted = Decoded(want.tokens, [rows, rows + np.float32(off)])
        assert compare(drifted, want)[0] == "FAIL"
