"""Ctrl-C as users and process managers send it: the first drains (tests/integration/test_load.py),
a second one while the engine core stops stops everything at once: one log line, no traceback,
exit status 130, no process of the server's left. (A second one while requests drain cuts the
drain short: `edge/asgi_server.py`.)"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server import START_TIMEOUT, wait_for_health

from triode.edge.bench.server_process import group_alive
from triode.wire.ports import free_port

pytestmark = pytest.mark.slow


def test_a_second_sigint_while_the_engine_core_stops_stops_at_once_quietly(
    tmp_path: Path,
) -> None:
    """The second signal must land while the engine core stops (a second or less): a run
    whose stop ended first exits 0, and another is tried; none may print a traceback."""
    statuses = []
    for attempt in range(3):
        status, output = _interrupt_twice(tmp_path / f"serve{attempt}.log")
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        statuses.append(status)
        if status == 130:
            assert "stopped at once" in output.splitlines()[-1]
            break
        assert status == 0, output
    assert statuses[-1] == 130, statuses


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_twice(log: Path) -> tuple[int, str]:
    """Serve tiny-random, SIGINT it, and SIGINT it again as soon as it stops its engine core:
    its exit status and output, once no process of it is left."""
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", "tiny-random", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # as from a terminal: pytest-xdist's workers ignore SIGINT, and a child inherits
            # that (Python then keeps ignoring it, as it should for a background job)
            preexec_fn=_default_sigint,
        )
    try:
        wait_for_health(process, f"http://127.0.0.1:{port}", log, START_TIMEOUT)
        process.send_signal(signal.SIGINT)  # drains, then stops the engine core ...
        deadline = time.monotonic() + 30
        while "stopping the engine core" not in log.read_text(errors="replace"):
            if process.poll() is not None:
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)  # ... which this one cuts short
        status = process.wait(30)
        deadline = time.monotonic() + 10
        while group_alive(process.pid):
            assert time.monotonic() < deadline, "a process of the server outlived it"
            time.sleep(0.1)
        return status, log.read_text(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_second_sigint_while_requests_drain_stops_at_once_quietly(tmp_path: Path) -> None:
    """A stream in flight keeps the first SIGINT's drain going; the second one ends it at once,
    as an interrupt: exit status 130, one line, no traceback, no process left."""
    port = free_port()
    log = tmp_path / "drain.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", "tiny-random", "--port", str(port),
             "--graceful-timeout", "60"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_default_sigint,
        )  # fmt: skip
    try:
        wait_for_health(process, f"http://127.0.0.1:{port}", log, START_TIMEOUT)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        stream = connection.getresponse()
        assert stream.status == 200
        assert stream.readline().startswith(b"data: ")  # it is streaming
        process.send_signal(signal.SIGINT)  # drains: the stream goes on ...
        deadline = time.monotonic() + 30
        while "finishing in-flight requests" not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        process.send_signal(signal.SIGINT)  # ... until this one
        status = process.wait(30)
        connection.close()
        deadline = time.monotonic() + 10
        while group_alive(process.pid):
            assert time.monotonic() < deadline, "a process of the server outlived it"
            time.sleep(0.1)
        output = log.read_text(errors="replace")
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert status == 130, output
        assert "stopped at once" in output.splitlines()[-1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_sigint_while_the_command_loads_ends_it_quietly(tmp_path: Path) -> None:
    """Ctrl-C in the first fraction of a second, while Python loads the command's modules
    (about 0.9 s here; entering the command takes 0.05 s): exit status 130 and no traceback."""
    log = tmp_path / "early.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge", "serve", "tiny-random", "--port",
             str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_default_sigint,
        )  # fmt: skip
    try:
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        status = process.wait(30)
        output = log.read_text(errors="replace")
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert status == 130, output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
