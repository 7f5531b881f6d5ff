"""Ctrl-C as users and process managers send it: the first drains (tests/integration/test_load.py),
a second one while the engine core stops stops everything at once: one log line, no traceback,
exit status 130, no process of the server's left. (A second one while requests drain cuts the
drain short: `edge/asgi_server.py`.)"""

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


def test_a_second_sigint_while_the_engine_core_stops_stops_at_once_quietly(
    tmp_path: Path,
) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", "tiny-random", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_health(process, f"http://127.0.0.1:{port}", log, START_TIMEOUT)
        process.send_signal(signal.SIGINT)  # drains, then stops the engine core ...
        deadline = time.monotonic() + 30
        while "stopping the engine core" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)  # ... which this one cuts short
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
