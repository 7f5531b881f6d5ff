"""Cross-process edges: trio channels over ZMQ sockets.

An edge inside a process is a bounded `trio.open_memory_channel`; an edge between processes is
one of these. Both are `trio.abc` channels carrying the same message types, so moving an actor to
another process changes how its edges are built, not its code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import trio

from triode.wire import Buffer, ProtocolError, Socket

T = TypeVar("T")
log = logging.getLogger(__name__)


class ZmqSendChannel(trio.abc.SendChannel[T], Generic[T]):
    """Sends each value as one multipart message. The channel owns its socket."""

    def __init__(self, socket: Socket, encode: Callable[[T], list[Buffer]]) -> None:
        self._socket = socket
        self._encode = encode

    async def send(self, value: T) -> None:
        """Encode and send. A checkpoint; cancelled means the value was not sent."""
        await self._socket.send_multipart(self._encode(value), copy=False)

    async def aclose(self) -> None:
        await self._socket.aclose()


class ZmqReceiveChannel(trio.abc.ReceiveChannel[T], Generic[T]):
    """Receives and decodes one message per call. Frames that do not decode are logged,
    counted in `protocol_errors`, and skipped: a bad frame never ends the channel."""

    def __init__(self, socket: Socket, decode: Callable[[Sequence[Any]], T]) -> None:
        self._socket = socket
        self._decode = decode
        self.protocol_errors = 0

    async def receive(self) -> T:
        """A checkpoint; cancelled means no message was taken."""
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            try:
                return self._decode([f.buffer for f in frames])
            except ProtocolError as e:
                self.protocol_errors += 1
                log.warning("dropped an undecodable message: %s", e)

    async def aclose(self) -> None:
        await self._socket.aclose()
