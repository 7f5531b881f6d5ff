"""Server-Sent Events: `event` framing and the incremental `SSEParser`.

Framed payloads come back out of the parser exactly, in order, however the stream is cut into
chunks and whatever keep-alive comments sit between them; a payload with a line break is refused
with ValueError. On arbitrary bytes the parser never raises, and the chunking never changes
what it yields.

Input layout: a mode byte; even, `events`: payloads and chunk sizes drawn from the bytes (see
`events_input`); odd, `stream`: chunk sizes, then the raw stream.
"""

from __future__ import annotations

from triode.edge.sse import DONE, KEEPALIVE, SSEParser, event, parse

from .source import ByteSource

BYTE_BY_BYTE_MAX = 8192  # longer streams are fed in the chunk sizes the input gives

DICTIONARY = [b"data:", b"data: ", b"\n\n", b"\r\n", b"\r", b": keep-alive\n\n", b"[DONE]",
              b"event: ", b"id: ", b":"]  # fmt: skip


def events_input(payloads: list[bytes], cuts: list[int] | None = None) -> bytes:
    """The `events`-mode input for `payloads` (for seed corpora)."""
    out = bytearray([0, len(payloads)])
    for payload in payloads:
        out += len(payload).to_bytes(2, "little") + payload + b"\0"
    return bytes(out + bytes(cuts or []))


def stream_input(stream: bytes, cuts: list[int]) -> bytes:
    """The `stream`-mode input that feeds `stream` cut after `cuts` bytes each (seed corpora)."""
    return bytes([1, len(cuts), *cuts]) + stream


def test_one_input(data: bytes) -> None:
    src = ByteSource(data)
    if src.byte() % 2 == 0:
        _events(src)
    else:
        _stream(src)


def _events(src: ByteSource) -> None:
    payloads: list[bytes] = []
    stream = bytearray()
    for _ in range(src.byte()):
        payload = src.take(src.int(0, 0xFFFF))
        extras = src.byte()
        try:
            framed = event(payload)
        except ValueError:
            assert b"\n" in payload or b"\r" in payload
            continue
        assert b"\n" not in payload and b"\r" not in payload
        payloads.append(payload)
        stream += framed
        if extras & 1:
            stream += KEEPALIVE
        if extras & 2:
            stream += b": " + payload + b"\n\n"  # a comment that looks like the payload
    stream += DONE
    got = _feed(bytes(stream), [src.byte() for _ in range(min(src.remaining, 64))])
    assert got == [*payloads, b"[DONE]"], "framed payloads did not come back"


def _stream(src: ByteSource) -> None:
    cuts = [src.byte() for _ in range(src.byte() % 16)]
    stream = src.rest()
    whole = parse(stream)
    assert all(isinstance(data, bytes) for data in whole)
    assert _feed(stream, cuts) == whole, "the chunking changed the events"
    if len(stream) <= BYTE_BY_BYTE_MAX:
        assert _feed(stream, [1]) == whole, "byte-by-byte feeding changed the events"


def _feed(stream: bytes, cuts: list[int]) -> list[bytes]:
    """The events of `stream` fed as chunks of the sizes in `cuts` (cycled), then the rest."""
    parser = SSEParser()
    events: list[bytes] = []
    pos = 0
    for i in range(len(stream)):
        if pos >= len(stream) or not cuts:
            break
        size = cuts[i % len(cuts)]
        events += parser.feed(stream[pos : pos + size])
        pos += size
    events += parser.feed(stream[pos:])
    return events
