"""Every fuzz harness runs clean on a fixed number of inputs, and the runner keeps its
promises: a fixed seed gives the same inputs, a failure or a hang is saved and reproduces,
atheris drives the same harnesses."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from triode.fuzz import run
from triode.fuzz.harnesses import HARNESSES, load
from triode.fuzz.make_corpus import write_corpus
from triode.fuzz.mutator import Mutator

SEED = 20240601
# Inputs each harness runs in the suite, from SEED: the same inputs every run, a second or two
# of work on a loaded 2-core machine (`make fuzz` runs each for minutes). A harness whose inputs
# do not all run within TIMEOUT hangs.
RUNS = {
    "wire": 12000,
    "http_body": 6000,
    "auth": 12000,
    "sse": 600,
    "chat": 450,
    "scheduler": 750,
    "shm_ring": 15000,
    "kv_server": 6000,
    "kv_seal": 12000,
}
TIMEOUT = 120.0


@pytest.mark.slow
@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean_on_its_inputs(harness: str, tmp_path: Path) -> None:
    module = load(harness)
    seeds = run.read_corpus(run.CORPUS_DIR / harness)

    result = run.fuzz(
        harness,
        module.test_one_input,
        seeds,
        seconds=TIMEOUT,
        seed=SEED,
        max_runs=RUNS[harness],
        dictionary=getattr(module, "DICTIONARY", ()),
        crash_dir=tmp_path,
    )

    assert result.failure is None, f"reproducer bytes: {result.failure.data!r}\n" + (
        result.failure.traceback
    )
    assert result.executions == RUNS[harness]


def test_every_harness_has_a_seed_corpus() -> None:
    for harness in HARNESSES:
        assert run.read_corpus(run.CORPUS_DIR / harness), f"no seeds for {harness}"
    assert set(RUNS) == set(HARNESSES)


def test_make_corpus_writes_small_corpora_that_pass(tmp_path: Path) -> None:
    counts = write_corpus(tmp_path)

    assert set(counts) == set(HARNESSES) and all(counts.values())
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.bin")) < 1 << 20
    for harness in HARNESSES:
        target = load(harness).test_one_input
        for data in run.read_corpus(tmp_path / harness):
            assert run.run_input(target, data) is None, f"{harness} seed {data[:40]!r} fails"


def test_a_fixed_seed_gives_the_same_inputs() -> None:
    seeds = run.read_corpus(run.CORPUS_DIR / "wire")

    def inputs(seed: int) -> list[bytes]:
        mutator = Mutator(random.Random(seed), seeds, [b"\xc0", b"\x91"])
        return [next(mutator) for _ in range(2000)]

    first = inputs(7)
    assert first == inputs(7)
    assert first != inputs(8)
    assert first[: len(seeds)] == seeds  # every seed runs as it is first


def _fails_on_ff(data: bytes) -> None:
    assert b"\xff" not in data, "found the byte"


def test_a_failing_input_is_saved_and_reproduces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run.fuzz("sse", _fails_on_ff, [b"abc"], seconds=30, seed=1, crash_dir=tmp_path)

    assert result.failure is not None and result.failure.path is not None
    assert b"\xff" in result.failure.path.read_bytes()
    assert result.failure.path.name.startswith("sse-")
    assert "found the byte" in result.failure.traceback

    monkeypatch.setattr(run, "load", lambda name: SimpleNamespace(test_one_input=_fails_on_ff))
    assert run.main(["--reproduce", str(result.failure.path)]) == 1
    assert "found the byte" in capsys.readouterr().out
    monkeypatch.undo()
    assert run.main(["--reproduce", str(result.failure.path)]) == 0  # the real sse harness


def test_a_hang_is_a_failure(tmp_path: Path) -> None:
    def hangs(data: bytes) -> None:
        time.sleep(60)

    start = time.monotonic()
    result = run.fuzz("sse", hangs, [b""], seconds=30, timeout=0.2, crash_dir=tmp_path)

    assert time.monotonic() - start < 5
    assert result.failure is not None and "InputTimeout" in result.failure.traceback


@pytest.mark.slow
def test_the_command_line_runs_harnesses_and_reports_executions(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "triode.fuzz.run", "sse", "auth", "--seconds", "1",
         "--seed", "3", "--crashes", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["sse", "auth"]
    assert all(line.endswith("ok") and "/s" in line for line in lines)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_atheris_drives_the_same_harnesses(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    result = run.fuzz_with_atheris(
        "sse", run.CORPUS_DIR, seconds=2, seed=3, timeout=10, crash_dir=tmp_path
    )

    assert result.failure is None, result.failure.traceback
    assert result.executions > 100
