"""The transport case's echo peer: a second process that binds PULL and PUSH over `ipc://` and
sends every message back, through the trio adapter or through blocking pyzmq; and the blocking
sockets that the raw pyzmq side uses in peer and client alike.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import trio
import zmq

from ..zsocket import Socket


def run_peer(kind: str, in_addr: str, out_addr: str) -> None:
    """Bind PULL on `in_addr` and PUSH on `out_addr`; echo frames unchanged until killed."""
    if kind == "trio":
        trio.run(_echo_trio, in_addr, out_addr)
    else:
        _echo_raw(in_addr, out_addr)


async def _echo_trio(in_addr: str, out_addr: str) -> None:
    with zmq.Context() as ctx:
        async with (
            Socket.open(ctx, zmq.PULL, bind=in_addr) as pull,
            Socket.open(ctx, zmq.PUSH, bind=out_addr) as push,
        ):
            while True:
                await push.send_multipart(await pull.recv_multipart())


def _echo_raw(in_addr: str, out_addr: str) -> None:
    with (
        zmq.Context() as ctx,
        raw_socket(ctx, zmq.PULL, bind=in_addr) as pull,
        raw_socket(ctx, zmq.PUSH, bind=out_addr) as push,
    ):
        while True:
            push.send_multipart(pull.recv_multipart(copy=False), copy=False)


@contextlib.contextmanager
def raw_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    timeout: float | None = None,
) -> Iterator[zmq.Socket]:
    """A blocking socket configured as `Socket.open` configures its own (no HWM, no linger).

    With a `timeout` (seconds), a receive that waits longer raises `zmq.Again`.
    """
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if timeout is not None:
            sock.setsockopt(zmq.RCVTIMEO, round(timeout * 1000))
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
        yield sock
    finally:
        sock.close(linger=0)


@contextlib.contextmanager
def echo_peer(kind: str) -> Iterator[tuple[str, str]]:
    """Start an echo peer process; yield its (in, out) addresses; always kill it afterwards."""
    tmp = tempfile.mkdtemp(prefix="triode-bench-")
    in_addr, out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    cmd = [sys.executable, "-m", "triode.wire.bench", "--peer", kind]
    try:
        with subprocess.Popen([*cmd, "--in", in_addr, "--out", out_addr]) as proc:
            try:
                yield in_addr, out_addr
            except (trio.TooSlowError, zmq.Again) as e:
                raise RuntimeError(f"{kind} echo peer stalled (exit code {proc.poll()})") from e
            finally:
                proc.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
