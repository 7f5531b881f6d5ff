"""Server-Sent Events: framing for the server, and a small parser for clients and tests."""

from __future__ import annotations

from typing import Final

DONE: Final = b"data: [DONE]\n\n"
KEEPALIVE: Final = b": keep-alive\n\n"

SSE_HEADERS: Final[list[tuple[bytes, bytes]]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Stops nginx-style proxies from holding chunks back.
    (b"x-accel-buffering", b"no"),
]


def event(payload: bytes, name: str | None = None) -> bytes:
    """One `data:` event, named with an `event:` line when `name` is given (the Responses API
    names each). `payload` and `name` must be single lines (compact JSON); else ValueError."""
    if b"\n" in payload or b"\r" in payload:
        raise ValueError("an SSE data payload must not contain line breaks")
    if name is None:
        return b"data: " + payload + b"\n\n"
    if "\n" in name or "\r" in name:
        raise ValueError("an SSE event name must not contain line breaks")
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


class SSEParser:
    """Incremental parser: feed bytes as they arrive, get the data of each completed event.

    Lines may end in `\\n` or `\\r\\n`; comments and fields other than `data` are ignored;
    multi-line data is joined with `\\n`.
    """

    def __init__(self) -> None:
        # The unfinished line's chunks, joined only once the line ends: joining on every feed
        # would make a long line that arrives in small chunks cost quadratic time.
        self._partial: list[bytes] = []
        self._data: list[bytes] | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data payloads of the events that `chunk` completes, in order."""
        if b"\n" not in chunk:
            self._partial.append(chunk)
            return []
        lines = chunk.split(b"\n")
        lines[0] = b"".join([*self._partial, lines[0]])
        self._partial = [lines.pop()]
        events: list[bytes] = []
        for raw in lines:
            line = raw.removesuffix(b"\r")
            if not line:
                if self._data is not None:
                    events.append(b"\n".join(self._data))
                    self._data = None
            elif not line.startswith(b":"):
                name, _, value = line.partition(b":")
                if name == b"data":
                    if self._data is None:
                        self._data = []
                    self._data.append(value.removeprefix(b" "))
        return events


def parse(stream: bytes) -> list[bytes]:
    """The data payloads of the complete events in `stream`; a trailing partial event is dropped."""
    return SSEParser().feed(stream)
