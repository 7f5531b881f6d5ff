"""The shared-memory ring's reader on hostile chunk content: whatever a chunk holds reads as
exactly the frames its header describes, or raises `ProtocolError`, and the ring goes on.

Each input becomes the raw content (header and payload, laid out as `triode.wire.shm_segment`
says; truncated or zero-padded to the chunk) of the chunk holding the next message, after the
writer published it. That message is written too big for a chunk, so it travels on ZMQ too:
content that reads as the overflow marker finds it there, and no input makes the reader wait.
One ring serves every input, as one ring serves every step, so state a bad chunk leaves behind
shows up in later inputs.
"""

from __future__ import annotations

import atexit
import struct

import zmq

from triode.wire import ProtocolError, ShmRingReader, ShmRingWriter
from triode.wire.shm_segment import RingSegment

CHUNK_BYTES = 512
N_CHUNKS = 2
TIMEOUT = 5.0  # seconds; only reached when the reader waits, which is a bug here
_HEADER = struct.Struct("=BxxxII")  # kind, n_frames, body_len
_INLINE, _OVERFLOW = 1, 2
_BIG = b"\xab" * CHUNK_BYTES  # never fits a chunk, so it always also goes on ZMQ

# Headers at the edges: no frames, the marker, counts and lengths at their limits.
DICTIONARY = [_HEADER.pack(_INLINE, 0, 0), _HEADER.pack(_OVERFLOW, 0, 0),
              _HEADER.pack(_INLINE, 1, CHUNK_BYTES - 16), _HEADER.pack(_INLINE, 125, 0),
              b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x01\x00\x00\x00",
              b"\x00\x02\x00\x00"]  # fmt: skip


class _Ring:
    """One writer, its reader, and a second mapping of the segment to scribble on."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.writer = ShmRingWriter(
            1, zmq_context=self.context, chunk_bytes=CHUNK_BYTES, n_chunks=N_CHUNKS
        )
        self.reader = ShmRingReader(self.writer.handle, 0, zmq_context=self.context)
        self.segment = RingSegment.attach(self.writer.handle)
        self.writer.wait_for_subscribers(timeout=TIMEOUT)
        self.written = 0
        atexit.register(self.close)

    def close(self) -> None:
        self.segment.close()
        self.reader.close()
        self.writer.close()
        self.context.destroy(linger=0)


_ring: _Ring | None = None  # opened by the first input, so that importing opens nothing


def test_one_input(data: bytes) -> None:
    global _ring
    if _ring is None:
        _ring = _Ring()
    ring = _ring
    chunk = ring.written % N_CHUNKS
    ring.writer.write([_BIG], timeout=TIMEOUT)
    ring.written += 1
    ring.segment.overwrite_chunk(chunk, data)
    expected = described_frames(data)
    try:
        frames = ring.reader.read(timeout=TIMEOUT)
    except ProtocolError as e:
        assert isinstance(e.args[0], str)
        assert expected is None, f"refused content that describes {len(expected)} frames"
        return
    assert expected is not None, "read frames out of content that describes none"
    assert [bytes(frame) for frame in frames] == expected


def described_frames(data: bytes) -> list[bytes] | None:
    """The frames that `data` as chunk content describes (None: no valid message). Written
    apart from the reader, from the layout alone."""
    content = data[:CHUNK_BYTES].ljust(CHUNK_BYTES, b"\0")
    kind, n_frames, body_len = _HEADER.unpack_from(content)
    if kind == _OVERFLOW:
        return [_BIG]
    body_at = _HEADER.size + 4 * n_frames
    if kind != _INLINE or body_at + body_len > CHUNK_BYTES:
        return None
    lengths = [int.from_bytes(content[i : i + 4], "little") for i in range(12, body_at, 4)]
    if sum(lengths) != body_len:
        return None
    frames = []
    for length in lengths:
        frames.append(content[body_at : body_at + length])
        body_at += length
    return frames


def chunk_input(frames: list[bytes], *, kind: int = _INLINE) -> bytes:
    """The chunk content that holds `frames` (for seed corpora)."""
    lengths = b"".join(len(f).to_bytes(4, "little") for f in frames)
    return _HEADER.pack(kind, len(frames), sum(map(len, frames))) + lengths + b"".join(frames)


def seeds() -> list[bytes]:
    """Valid messages of a step's shapes, the marker, and the edges of a chunk."""
    fit = CHUNK_BYTES - _HEADER.size - 8
    return [
        chunk_input([]),
        chunk_input([b""]),
        chunk_input([b"\x93\x07\x92\xa1a\xa1b\x90", b"", b"\x01" * 40]),
        chunk_input([b"x" * (fit - 1), b"y"]),
        chunk_input([], kind=_OVERFLOW),
        chunk_input([b"x" * fit, b"y"]),  # one byte too many
        _HEADER.pack(_INLINE, 0xFFFFFFFF, 4) + b"\x04\x00\x00\x00",
    ]
