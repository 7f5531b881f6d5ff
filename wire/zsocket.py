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

# Plain ints: pyzmq's flag enums cost an enum construction on every `|` and `&`.
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)


class Socket:
    """A trio view of a sync `zmq.Socket`. Owns the socket: closing this closes it."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._closed = False
        self._busy = False
        self._linger = sock.getsockopt(zmq.LINGER)

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
        options: Sequence[tuple[int, Any]] = (),
    ) -> Socket:
        """Create, configure and bind or connect a socket. `hwm=0` means unbounded. `options`
        are set before the bind or connect (CurveZMQ keys must be)."""
        sock = ctx.socket(kind)
        try:
            for option, value in options:
                sock.setsockopt(option, value)
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
        self._acquire()
        try:
            while True:
                try:
                    tracker = self._send(frames, copy, track)
                except zmq.Again:
                    await self._wait(_POLLOUT)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return tracker
        finally:
            self._busy = False

    def _send(self, frames: Sequence[Any], copy: bool, track: bool) -> zmq.MessageTracker | None:
        # Only the first part can raise zmq.Again: ZMQ queues a multipart message whole.
        send = self._sock.send
        last = len(frames) - 1
        if last < 0:
            raise ValueError("cannot send an empty multipart message")
        for frame in frames[:last]:
            send(frame, _NOBLOCK_SNDMORE, copy=copy, track=track)
        return send(frames[last], _NOBLOCK, copy=copy, track=track)

    async def recv_multipart(self, *, copy: bool = False) -> list[Any]:
        """Receive one multipart message (`zmq.Frame`s unless `copy=True`). A checkpoint.

        Cancelled means no message was taken; the next call receives it.
        """
        self._acquire()
        try:
            while True:
                try:
                    frames = self._recv(copy)
                except zmq.Again:
                    await self._wait(_POLLIN)
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return frames
        finally:
            self._busy = False

    def _recv(self, copy: bool) -> list[Any]:
        recv = self._sock.recv
        frame = recv(_NOBLOCK, copy=copy)
        frames = [frame]
        if copy:
            get = self._sock.get
            while get(_RCVMORE):
                frames.append(recv(_NOBLOCK, copy=True))
        else:
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
        return frames

    def _acquire(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("socket was closed")
        if self._busy:
            raise trio.BusyResourceError("another task is using this socket")
        self._busy = True

    def close(self) -> None:
        """Close at once, dropping unsent messages (linger 0). Idempotent; not a checkpoint."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=self._linger)

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
            if self._sock.get(_EVENTS) & event:
                return
            await trio.lowlevel.wait_readable(self._fd)
