"""A dead engine core is started again under a running `triode serve`: the request it was
running ends at once with a clear error, the server says it restarts (503 with Retry-After on
`/health` and on new requests), then serves the same greedy answers and counts the restart.
Past `--max-engine-restarts` the server exits non-zero with one line and leaves no process
behind; with several API servers, each reconnects by itself."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from processes import actor_processes, alive
from server import Server, running_server, stream_and_kill, wait_for_health

from triode.actors.forkserver import Forkserver

pytestmark = pytest.mark.slow

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
          "ignore_eos": True}  # fmt: skip


def _greedy(server: Server) -> str:
    answer = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=60)
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"]


def _restarts(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    [value] = re.findall(r"^triode:engine_restarts_total\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def test_a_killed_engine_core_is_started_again_mid_stream(model_dir: Path, tmp_path: Path) -> None:
    with running_server(["--max-model-len", "2048"], tmp_path / "serve.log") as server:
        before = _greedy(server)
        assert _restarts(server) == 0
        events, ended = stream_and_kill(server, server.engine_pid())
        # the stream that had started ends at once: its choice aborted, then the error
        assert ended < 2.0
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "starting again" in error["message"]
        [choice] = json.loads(events[-3])["choices"]
        assert choice["finish_reason"] == "abort"
        # while another engine core starts: 503 with Retry-After, for probes and requests
        health = httpx.get(f"{server.url}/health", timeout=2)
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
        refused = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=2)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        wait_for_health(server.process, server.url, server.log, 120)
        assert _greedy(server) == before
        assert _restarts(server) == 1
        assert "engine-core died (killed by SIGKILL); starting it again (restart 1)" in (
            server.output()
        )


def test_past_the_restart_budget_the_server_exits_with_one_line(
    tmp_path: Path, forkserver: Forkserver
) -> None:
    args = ["tiny-random", "--max-engine-restarts", "1", "--engine-restart-window", "600"]
    with running_server(args, tmp_path / "serve.log") as server:
        first = server.engine_pid()
        os.kill(first, signal.SIGKILL)
        second = server.restarted_engine_pid(1)
        wait_for_health(server.process, server.url, server.log, 120)
        os.kill(second, signal.SIGKILL)
        assert server.process.wait(30) == 1
        lines = [line for line in server.output().splitlines() if line.startswith("triode serve:")]
        assert lines == [
            "triode serve: engine-core died 2 time(s) within 600 s, more than "
            "--max-engine-restarts 1 allows; last: killed by SIGKILL"
        ]
        assert not actor_processes(server.process.pid, forkserver.pid)
        assert not alive(second)


def test_each_api_server_reconnects_to_the_engine_core_started_again(
    tmp_path: Path, forkserver: Forkserver
) -> None:
    args = ["tiny-random", "--api-server-count", "2"]
    with running_server(args, tmp_path / "serve.log") as server:
        before = _greedy(server)
        actors = actor_processes(server.process.pid, forkserver.pid)
        assert {"api-server-0", "api-server-1", "engine-core"} <= set(actors)
        os.kill(actors["engine-core"], signal.SIGKILL)
        server.restarted_engine_pid(1)
        for index in range(2):
            deadline = time.monotonic() + 30
            while f"[api-server-{index}] triode.actors.core_client: engine core 0 is back" not in (
                server.output()
            ):
                assert time.monotonic() < deadline, server.output()
                time.sleep(0.1)
        # new connections land on either API server: every answer comes from the new core
        assert [_greedy(server) for _ in range(6)] == [before] * 6
        after = actor_processes(server.process.pid, forkserver.pid)
        assert after["api-server-0"] == actors["api-server-0"]  # the API servers stayed up
        assert after["engine-core"] != actors["engine-core"]
