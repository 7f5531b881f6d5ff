"""The chaos harness: its judgements in isolation (each can find a violation), then a short run
against tiny-random, with kills, that must find none."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from triode.fuzz.live.chaos_checks import MIN_TREND_SAMPLES, Ledger
from triode.fuzz.live.chaos_load import Outcome, _streamed, _whole

# the suite's run: both servers, 12 s of load each, a kill every few seconds
SHORT_RUN = ["--minutes", "0.4", "--seed", "3", "--kill-every", "4", "--operate-every", "2"]


def _chunk(index: int, finish_reason: str | None = None) -> bytes:
    return json.dumps({"choices": [{"index": index, "finish_reason": finish_reason}]}).encode()


def test_a_stream_ends_once_with_every_choice_finished_once() -> None:
    assert _streamed([_chunk(0), _chunk(0, "stop"), b"[DONE]"], 1)[0] == "ok"
    error = json.dumps({"error": {"message": "the engine core died", "code": 503}}).encode()
    assert _streamed([_chunk(0), _chunk(0, "abort"), error, b"[DONE]"], 1)[:2] == ("error", 503)
    for events, n in (
        ([_chunk(0), _chunk(0, "stop")], 1),  # no [DONE]
        ([_chunk(0, "stop"), b"[DONE]", b"[DONE]"], 1),
        ([_chunk(0, "stop"), _chunk(1, "stop"), _chunk(1, "stop"), b"[DONE]"], 2),
        ([_chunk(0, "stop"), b"[DONE]"], 2),  # one choice never finished
        ([error, _chunk(0, "stop"), b"[DONE]"], 1),  # a chunk after the error
    ):
        assert _streamed(events, n)[0] == "bad", events


def test_a_whole_answer_needs_every_choice_finished_and_an_error_its_shape() -> None:
    answer = {"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]}
    assert _whole(httpx.Response(200, json=answer), 2)[0] == "ok"
    assert _whole(httpx.Response(200, json=answer), 3)[0] == "bad"
    assert _whole(httpx.Response(200, json={"choices": [{"finish_reason": None}]}), 1)[0] == "bad"
    shaped = {"error": {"message": "the engine is restarting; retry shortly"}}
    assert _whole(httpx.Response(503, json=shaped), 1)[:2] == ("error", 503)
    assert _whole(httpx.Response(503, text="Service Unavailable"), 1)[0] == "bad"


def test_a_503_or_a_lost_connection_counts_only_around_a_kill() -> None:
    ledger = Ledger("test")
    now = time.monotonic()
    ledger.record(Outcome("chat", now, now + 0.1, "error", 503))
    ledger.record(Outcome("chat", now, now + 0.1, "lost"))
    assert len(ledger.no_5xx.violations) == 2
    window = ledger.killed("engine-core")
    later = time.monotonic()
    ledger.record(Outcome("chat", later, later + 0.1, "error", 503))
    ledger.record(Outcome("chat", later, later + 0.1, "lost"))
    ledger.recovered(window)
    ledger.record(Outcome("chat", later, later + 0.1, "error", 500))  # never allowed
    assert len(ledger.no_5xx.violations) == 3 and "500" in ledger.no_5xx.violations[-1]
    ledger.record(Outcome("chat", later, later + 0.1, "bad", 200, "no [DONE]"))
    assert ledger.ended_once.violations == [f"chat at {later - ledger.started:.1f} s: no [DONE]"]


def test_memory_that_keeps_rising_is_a_trend_and_noise_is_not() -> None:
    rising, flat = Ledger("rising"), Ledger("flat")
    for i in range(3 * MIN_TREND_SAMPLES):
        rising.memory.append((2.0 * i, (1000 + 10 * i) << 20))  # +300 MiB a minute
        flat.memory.append((2.0 * i, (1000 + (i % 5) * 20) << 20))
    rising.judge_memory()
    flat.judge_memory()
    assert len(rising.trend.violations) == 1 and not flat.trend.violations
    assert "+300.0 MiB/min" in rising.memory_trend


@pytest.mark.slow
def test_a_short_run_with_kills_finds_no_violation() -> None:
    command = [sys.executable, "-m", "triode.fuzz.live", "chaos", *SHORT_RUN]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    pattern = r"^chaos (\w+) .*\n  kills (\d+) .* engine restarts (\d+)"
    tables = re.findall(pattern, done.stdout, re.M)
    assert [name for name, _, _ in tables] == ["parallel", "speculative"], done.stdout
    for _, kills, restarts in tables:
        assert int(kills) >= 1 and int(restarts) >= 1, done.stdout
    rows = re.findall(r"^  (\S.*?)\s+(\d+)\s+(\d+)$", done.stdout, re.M)
    assert len(rows) == 12 and all(violations == "0" for _, _, violations in rows), done.stdout
