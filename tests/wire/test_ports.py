"""Free ports come from below the kernel's ephemeral range, where no outgoing connection takes
them between the pick and the bind."""

from __future__ import annotations

import os
import random
import socket

import pytest

from triode.wire import ports


def test_a_free_port_is_below_the_ephemeral_range_and_binds() -> None:
    start = ports._ephemeral_start()
    assert start > ports.LOWEST  # this machine has room below its range
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_taken_meanwhile_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, busy + 1 if busy < 65535 else busy - 1])
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(picks))
        monkeypatch.setattr(ports, "LOWEST", 0)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        assert ports.free_port() != busy


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 1024)
    port = ports.free_port()
    assert port >= 1024
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_a_global_random_seed_does_not_choose_the_ports() -> None:
    # two processes (say, two test workers) whose global generator was seeded alike
    picks = []
    for _ in range(2):
        random.seed(1234)
        picks.append([ports.free_port() for _ in range(4)])
    assert picks[0] != picks[1]


def test_forked_children_draw_ports_of_their_own() -> None:
    picks = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves through os._exit
            try:
                os.write(write, repr([ports.free_port() for _ in range(4)]).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            picks.append(pipe.read())
        os.waitpid(pid, 0)
    assert picks[0] != picks[1]
