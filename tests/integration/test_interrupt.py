"""Ctrl-C as users and process managers send it: the first drains (tests/integration/test_load.py),
a second one, or one during start-up, stops everything at once: one log line, no traceback, exit
status 130, no process of the server's left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server import START_TIMEOUT, wait_for_health

from triode.wire.ports import free_port

pytestmark = pytest.mark.slow


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_a_sigint_with_no_drain_to_start_stops_at_once_quietly(when: str, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", "tiny-random", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if when == "serving":
            wait_for_health(process, f"http://127.0.0.1:{port}", log, START_TIMEOUT)
            process.send_signal(signal.SIGINT)  # drains ...
            time.sleep(0.05)
            process.send_signal(signal.SIGINT)  # ... and this one stops at once
        else:
            time.sleep(1.5)  # the engine core is starting
            process.send_signal(signal.SIGINT)
        assert process.wait(30) == 130
        output = log.read_text(errors="replace")
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert "stopped at once" in output.splitlines()[-1]
        deadline = time.monotonic() + 10
        while _group_alive(process.pid):
            assert time.monotonic() < deadline, "a process of the server outlived it"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
