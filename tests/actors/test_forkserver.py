"""Actors forked by a fork server: the same actor as an executed one, in the requester's
environment, supervised by the requester; and a server that only its own user can reach and
that hostile requests do not stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from processes import alive

from triode.actors import ActorDied, RemoteError, open_child
from triode.actors.forkserver import ENV, MAX_REQUEST, Forkserver, mismatch

HERE = Path(__file__).parent
PYTHONPATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Forkserver]:
    server = Forkserver({**os.environ, "PYTHONPATH": PYTHONPATH}).start()
    yield server
    pid = server.pid
    server.close()
    assert pid is not None and not alive(pid)
    assert not Path(server.path).exists()


@pytest.fixture
def forked(server: Forkserver, monkeypatch: pytest.MonkeyPatch) -> Forkserver:
    """This process asks `server` for its actors, in the environment the server has."""
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    monkeypatch.setenv(ENV, server.path)
    return server


def _facts(path: Path) -> dict:
    return json.loads(path.read_text())


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_only_variables_read_at_load_must_agree() -> None:
    own = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "TRIODE_CACHE": "/a", "HOME": "/root"}
    assert mismatch(own, {**own, "TRIODE_CACHE": "/b", "PATH": "/usr/bin"}) == []
    assert mismatch(own, {**own, "TORCHINDUCTOR_CACHE_DIR": "/t"}) == []  # torch sets it at use
    assert mismatch(own, {**own, "OMP_NUM_THREADS": "1"}) == ["OMP_NUM_THREADS"]
    assert mismatch(own, {**own, "MALLOC_ARENA_MAX": "2"}) == ["MALLOC_ARENA_MAX"]
    assert mismatch(own, {**own, "HF_HUB_OFFLINE": "1"}) == ["HF_HUB_OFFLINE"]
    assert mismatch(own, {**own, "PYTHONPATH": "/x", "HOME": "/h"}) == ["HOME", "PYTHONPATH"]
    assert mismatch(own, {k: v for k, v in own.items() if k != "OMP_NUM_THREADS"}) == [
        "OMP_NUM_THREADS"
    ]


async def test_a_forked_actor_runs_as_the_requesters_child_would(
    forked: Forkserver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIODE_TEST_MARK", "this request's")  # read at use: the request's
    cpus = sorted(os.sched_getaffinity(0))
    async with (
        open_child("child_targets:report_facts", options={"path": str(tmp_path / "a.json")}) as a,
        open_child(
            "child_targets:report_facts",
            name="a-long-actor-name-9",
            options={"path": str(tmp_path / "b.json")},
        ) as b,
    ):
        first, second = _facts(tmp_path / "a.json"), _facts(tmp_path / "b.json")
        # each named as its actor (what ps and top show), cut to the kernel's 15 bytes
        assert (first["comm"], second["comm"]) == ("report_facts", "a-long-actor-na")
        assert first["pid"] == a.pid and second["pid"] == b.pid
        assert first["ppid"] == second["ppid"] == forked.pid  # forked, not executed
        assert first["session"] == a.pid  # a session of its own, as an executed actor
        assert first["cwd"] == os.getcwd()
        assert first["cpus"] == cpus
        assert first["mark"] == "this request's"
        # each child draws its own random numbers, not the server's sequence
        assert first["random"] != second["random"]
        assert first["numpy_random"] != second["numpy_random"]
    assert a.returncode == b.returncode == 0
    assert a.stop_escalation == "graceful"
    assert not alive(a.pid) and not alive(b.pid)


async def test_another_environment_is_executed_instead(
    forked: Forkserver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by OpenMP at load: the server's differs
    async with open_child(
        "child_targets:report_facts", name="executed", options={"path": str(tmp_path / "f")}
    ):
        facts = _facts(tmp_path / "f")
        assert facts["ppid"] == os.getpid()
        assert facts["comm"] == "executed"


async def test_the_exit_status_of_a_forked_actor_reaches_its_requester(forked: Forkserver) -> None:
    with pytest.raises(ExceptionGroup) as info:
        async with open_child("child_targets:crash_after_ready") as child:
            await trio.sleep_forever()
    [error] = info.value.exceptions
    assert isinstance(error, RemoteError) and "asked this actor to fail" in str(error)
    assert child.returncode == 1

    async with open_child("child_targets:sleep_forever", raise_on_death=False) as child:
        os.kill(child.pid, signal.SIGKILL)
        await child.exited.wait()
        assert isinstance(child.error, ActorDied)
    assert child.returncode == -signal.SIGKILL


async def test_an_actor_that_ignores_sigterm_is_killed_through_its_pidfd(
    forked: Forkserver,
) -> None:
    async with open_child(
        "child_targets:ignore_sigterm", shutdown_timeout=0.2, terminate_timeout=0.2
    ) as child:
        pass
    assert child.stop_escalation == "killed"
    assert child.returncode == -signal.SIGKILL


REQUESTER = """
import os, sys, trio
from triode.actors import open_child

async def main():
    async with open_child("child_targets:sleep_forever") as child:
        print(child.pid, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def test_a_forked_actor_leaves_when_its_requester_dies(forked: Forkserver) -> None:
    with subprocess.Popen([sys.executable, "-c", REQUESTER], stdout=subprocess.PIPE) as requester:
        assert requester.stdout is not None
        pid = int(requester.stdout.readline())
        stat = Path(f"/proc/{pid}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[1] == str(forked.pid)
        requester.kill()
    assert _gone_within(pid, 10)
    assert alive(forked.pid)  # the server serves on


def _raw_request(path: str, head: bytes, body: bytes = b"", *, fds: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        try:
            if fds:
                socket.send_fds(s, [head], [0, 1, 2])
            else:
                s.sendall(head)
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
            return s.recv(1 << 16)
        except (ConnectionResetError, BrokenPipeError):  # closed with the request unread
            return b""


async def test_hostile_requests_are_dropped_and_the_server_serves_on(
    forked: Forkserver, tmp_path: Path
) -> None:
    assert _raw_request(forked.path, struct.pack("!I", MAX_REQUEST + 1), b"x" * 64) == b""
    assert _raw_request(forked.path, struct.pack("!I", 5), b"\xc1\xc1\xc1\xc1\xc1") == b""
    assert _raw_request(forked.path, struct.pack("!I", 1), b"\x90", fds=False) == b""
    assert _raw_request(forked.path, b"\x00") == b""  # a truncated length
    async with open_child("child_targets:report_facts", options={"path": str(tmp_path / "f")}):
        assert _facts(tmp_path / "f")["ppid"] == forked.pid


def test_another_user_cannot_reach_the_server(forked: Forkserver) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to try as another user")
    assert os.stat(Path(forked.path).parent).st_mode & 0o777 == 0o700
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the probe leaves through os._exit
        code = 2
        try:
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(forked.path)
            code = 1
        except PermissionError:
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


OWNER = """
import sys
from triode.actors.forkserver import Forkserver
server = Forkserver().start()
print(server.pid, flush=True)
sys.stdin.read()
"""


def test_the_server_leaves_with_its_owner() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as owner:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        path = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3].decode()
        assert alive(pid) and Path(path).exists()
        owner.kill()
    assert _gone_within(pid, 10)
    assert not Path(path).parent.exists()  # it took its socket with it
