"""pyzmq sockets under trio.

One task owns each socket. Every operation has the shape of trio's own non-blocking sockets: try
the call with NOBLOCK; on success take a cancel-shielded checkpoint (so a cancellation can never
strike after a message was taken and lose it); on `zmq.Again` read `zmq.EVENTS` and, only if the
socket is still not ready, wait for ZMQ's edge-triggered fd to turn readable. Closing notifies
trio first, so a task blocked on the socket raises `trio.ClosedResourceError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
import zmq


class Socket:
    """A trio view of a sync `zmq.Socket`. Owns the socket: closing this closes it."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._closed = False
        self._busy = False

    @classmethod
    def open(
        cls,
        ctx: zmq.Context,
        kind: int,
        *,
        bind: str | None = None,
        connect: str | None = None,
        hwm: int = 0,
        linger: int = 0,
        subscribe: bytes | None = None,
    ) -> Socket:
        """Create, configure and bind or connect a socket. `hwm=0` means unbounded."""
        sock = ctx.socket(kind)
        try:
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.setsockopt(zmq.LINGER, linger)
            if subscribe is not None:
                sock.setsockopt(zmq.SUBSCRIBE, subscribe)
            if bind is not None:
                sock.bind(bind)
            if connect is not None:
                sock.connect(connect)
        except BaseException:
            sock.close(linger=0)
            raise
        return cls(sock)

    @property
    def zmq_socket(self) -> zmq.Socket:
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def last_endpoint(self) -> str:
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send_multipart(
        self, frames: Sequence[Any], *, copy: bool = False, track: bool = False
    ) -> zmq.MessageTracker | None:
        """Send one multipart message. A checkpoint.

        Cancelled means the message was not sent. With `track=True` the returned tracker says
        when ZMQ no longer needs the frames' memory.
        """
        with self._owner():
            while True:
                try:
                    tracker = self._sock.send_multipart(
                        frames, flags=zmq.NOBLOCK, copy=copy, track=track
                    )
                except zmq.Again:
                    await self._wait(zmq.POLLOUT)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return tracker

    async def recv_multipart(self, *, copy: bool = False) -> list[Any]:
        """Receive one multipart message (`zmq.Frame`s unless `copy=True`). A checkpoint.

        Cancelled means no message was taken; the next call receives it.
        """
        with self._owner():
            while True:
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
                except zmq.Again:
                    await self._wait(zmq.POLLIN)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return frames

    def close(self) -> None:
        """Close at once, dropping unsent messages (linger 0). Idempotent; not a checkpoint."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=0)

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Socket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _wait(self, event: int) -> None:
        # The fd is edge-triggered and signals any change of zmq.EVENTS, so check EVENTS
        # before sleeping: a message may already be queued with no edge left to wake us.
        while True:
            if self._closed:
                raise trio.ClosedResourceError("socket was closed")
            if self._sock.getsockopt(zmq.EVENTS) & event:
                return
            await trio.lowlevel.wait_readable(self._fd)

    def _owner(self) -> _Owner:
        if self._closed:
            raise trio.ClosedResourceError("socket was closed")
        return _Owner(self)


class _Owner:
    """Raises `trio.BusyResourceError` when a second task uses a socket mid-operation."""

    __slots__ = ("_socket",)

    def __init__(self, socket: Socket) -> None:
        self._socket = socket

    def __enter__(self) -> None:
        if self._socket._busy:
            raise trio.BusyResourceError("another task is using this socket")
        self._socket._busy = True

    def __exit__(self, *exc: object) -> None:
        self._socket._busy = False
