"""The shared-memory segment under `shm_ring`: its layout, and the chunk format.

One segment, created by the writer and mapped by every local reader:

    control   64 B     magic, version, n_readers, n_chunks, chunk_bytes, closed byte
    readers   8 B per reader, padded to 64: a sleeping byte, set while the reader blocks, and
              at offset 2 the u16 loopback UDP port that wakes it
    metadata  per chunk, 8-aligned: u64 written seq, then one read byte per reader
    data      n_chunks chunks of chunk_bytes, each 64-aligned

Message number m (0-based) goes into chunk m % n_chunks. The chunk's written seq is m + 1 once
the message is complete (0: never written), so a reader waiting for message m can tell it from
the message the chunk held a lap earlier. Each reader writes only its own bytes: after consuming
message m it sets its read byte to `tag(m)`, a lap counter in 1..255; the writer may reuse the
chunk for m + n_chunks once every live reader's byte holds `tag(m)`. A reader is never more than
one lap behind the writer, so 255 lap values cannot be confused.

A chunk holds `[kind u8, pad 3, n_frames u32, body_len u32][n_frames x u32 lengths][body]` in
native byte order (the segment never leaves the host). Kind 1 is inline; kind 2 marks a message
that travels on ZMQ instead (see `shm_ring`). Reading a chunk is total: any content returns
frames, the overflow marker, or raises `ProtocolError`, and bounds come from one read of the
header, so a writer scribbling over the chunk meanwhile cannot push a read out of bounds.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import struct
import sys
import threading
from collections.abc import Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Annotated

import msgspec

from .errors import ProtocolError

MAGIC = b"tRNG"
VERSION = 1
MAX_READERS = 1024
MAX_CHUNKS = 1 << 16
MIN_CHUNK_BYTES = 64

_CONTROL = struct.Struct("=4sIIIQ")  # magic, version, n_readers, n_chunks, chunk_bytes
_CLOSED = _CONTROL.size  # the writer's closed byte
_READERS = 64
_READER_SLOT = 8
_PORT = struct.Struct("=H")
_HEADER = struct.Struct("=BxxxII")  # kind, n_frames, body_len
_INLINE = 1
_OVERFLOW = 2


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader needs to join a ring; it travels to readers inside a message."""

    shm_name: str
    n_readers: Annotated[int, msgspec.Meta(ge=0, le=MAX_READERS)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=MIN_CHUNK_BYTES, lt=1 << 32)]
    n_chunks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]
    overflow_address: str
    # the loopback UDP port the writer's wake-ups come from; a reader drops any other sender's
    writer_wake_port: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)] = 0


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier. CPython has no fence primitive, but a lock's acquire and release
    are atomic read-modify-writes, which order every load and store around them (x86 would
    otherwise let a load pass an earlier store, which breaks the sleeping-byte handshake)."""
    _FENCE.acquire()
    _FENCE.release()


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


class RingSegment:
    """A mapped ring segment. `create` makes one (the writer owns and unlinks it); `attach` maps
    an existing one, checking that it is the segment `handle` describes."""

    def __init__(self, shm: SharedMemory, n_readers: int, n_chunks: int, chunk_bytes: int) -> None:
        self.n_readers = n_readers
        self.n_chunks = n_chunks
        self.chunk_bytes = chunk_bytes
        self._shm = shm
        self._buf: memoryview = shm.buf
        self._closed = False
        self._meta_stride = _align(8 + n_readers, 8)
        self._meta = _align(_READERS + _READER_SLOT * n_readers, 64)
        self._data = _align(self._meta + n_chunks * self._meta_stride, 64)
        self._chunk_stride = _align(chunk_bytes, 64)
        # Written seqs are u64 stores through a native 'Q' view: one aligned 8-byte store, so a
        # reader never sees half of one.
        self._seqs = self._buf[self._meta : self._data].cast("Q")

    @staticmethod
    def size(n_readers: int, n_chunks: int, chunk_bytes: int) -> int:
        meta = _align(_READERS + _READER_SLOT * n_readers, 64)
        data = _align(meta + n_chunks * _align(8 + n_readers, 8), 64)
        return data + n_chunks * _align(chunk_bytes, 64)

    @classmethod
    def create(cls, n_readers: int, n_chunks: int, chunk_bytes: int) -> RingSegment:
        if not 0 <= n_readers <= MAX_READERS:
            raise ValueError(f"a ring has 0 to {MAX_READERS} local readers, not {n_readers}")
        if not 1 <= n_chunks <= MAX_CHUNKS:
            raise ValueError(f"a ring has 1 to {MAX_CHUNKS} chunks, not {n_chunks}")
        if not MIN_CHUNK_BYTES <= chunk_bytes < 1 << 32:
            raise ValueError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES} and below 4 GiB")
        shm = SharedMemory(create=True, size=cls.size(n_readers, n_chunks, chunk_bytes))
        _CONTROL.pack_into(shm.buf, 0, MAGIC, VERSION, n_readers, n_chunks, chunk_bytes)
        return cls(shm, n_readers, n_chunks, chunk_bytes)

    @classmethod
    def attach(cls, handle: RingHandle) -> RingSegment:
        """Map the segment `handle` names. ProtocolError if it is not that ring's segment;
        FileNotFoundError if no segment has that name (the writer closed it)."""
        shm = open_untracked(handle.shm_name)
        geometry = (handle.n_readers, handle.n_chunks, handle.chunk_bytes)
        try:
            if shm.size < cls.size(*geometry):
                raise ProtocolError(f"segment {handle.shm_name} is smaller than its handle says")
            if _CONTROL.unpack_from(shm.buf, 0) != (MAGIC, VERSION, *geometry):
                raise ProtocolError(f"segment {handle.shm_name} does not match its handle")
        except BaseException:
            shm.close()
            raise
        return cls(shm, *geometry)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        """Unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._seqs.release()
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment's name; mappings stay valid until each process closes its own."""
        self._shm.unlink()

    # Metadata

    def tag(self, seq: int) -> int:
        """The read byte that says message `seq` was consumed."""
        return (seq // self.n_chunks) % 255 + 1

    def written(self, chunk: int) -> int:
        return self._seqs[chunk * self._meta_stride // 8]

    def publish(self, chunk: int, seq: int) -> None:
        """Mark message `seq` complete in `chunk`: fenced, so that its payload is visible first
        and the writer's next loads (the sleeping bytes) come after."""
        fence()
        self._seqs[chunk * self._meta_stride // 8] = seq + 1
        fence()

    def read_flag(self, chunk: int, reader: int) -> int:
        return self._buf[self._meta + chunk * self._meta_stride + 8 + reader]

    def set_read_flag(self, chunk: int, reader: int, tag: int) -> None:
        fence()  # the copy out of the chunk happens before the writer may reuse it
        self._buf[self._meta + chunk * self._meta_stride + 8 + reader] = tag

    def sleeping(self, reader: int) -> bool:
        return self._buf[_READERS + _READER_SLOT * reader] != 0

    def set_sleeping(self, reader: int, sleeping: bool) -> None:
        self._buf[_READERS + _READER_SLOT * reader] = sleeping
        fence()  # before the reader checks the chunk once more

    def wake_port(self, reader: int) -> int:
        return _PORT.unpack_from(self._buf, _READERS + _READER_SLOT * reader + 2)[0]

    def set_wake_port(self, reader: int, port: int) -> None:
        _PORT.pack_into(self._buf, _READERS + _READER_SLOT * reader + 2, port)

    @property
    def closed(self) -> bool:
        return self._buf[_CLOSED] != 0

    def set_closed(self) -> None:
        fence()
        self._buf[_CLOSED] = 1

    # Chunks

    def fits(self, n_frames: int, body_len: int) -> bool:
        return _HEADER.size + 4 * n_frames + body_len <= self.chunk_bytes

    def write_frames(self, chunk: int, frames: Sequence[memoryview], body_len: int) -> None:
        """Write a message that `fits` into `chunk`; `frames` are byte views."""
        base = self._data + chunk * self._chunk_stride
        buf = self._buf
        _HEADER.pack_into(buf, base, _INLINE, len(frames), body_len)
        struct.pack_into(f"={len(frames)}I", buf, base + _HEADER.size, *map(len, frames))
        at = base + _HEADER.size + 4 * len(frames)
        for frame in frames:
            buf[at : at + len(frame)] = frame
            at += len(frame)

    def write_overflow_marker(self, chunk: int) -> None:
        _HEADER.pack_into(self._buf, self._data + chunk * self._chunk_stride, _OVERFLOW, 0, 0)

    def read_frames(self, chunk: int) -> list[memoryview] | None:
        """A copy of the message in `chunk`, one view per frame, or None for the overflow
        marker. ProtocolError for any header that does not describe frames inside the chunk."""
        base = self._data + chunk * self._chunk_stride
        kind, n_frames, body_len = _HEADER.unpack_from(self._buf, base)
        if kind == _OVERFLOW:
            return None
        if kind != _INLINE:
            raise ProtocolError(f"chunk {chunk} has unknown kind {kind}")
        if not self.fits(n_frames, body_len):
            raise ProtocolError(
                f"chunk {chunk} claims {n_frames} frames of {body_len} bytes in all, more than "
                f"its {self.chunk_bytes} bytes hold"
            )
        lengths = struct.unpack_from(f"={n_frames}I", self._buf, base + _HEADER.size)
        if sum(lengths) != body_len:
            raise ProtocolError(f"chunk {chunk}'s frame lengths do not add up to {body_len}")
        start = base + _HEADER.size + 4 * n_frames
        body = memoryview(bytes(self._buf[start : start + body_len]))
        frames = []
        at = 0
        for length in lengths:
            frames.append(body[at : at + length])
            at += length
        return frames

    def overwrite_chunk(self, chunk: int, content: bytes) -> None:
        """Replace `chunk`'s content with `content` (truncated, zero-padded), leaving its
        metadata alone: what a buggy or hostile process could leave there. For tests and fuzzing.
        """
        base = self._data + chunk * self._chunk_stride
        content = content[: self.chunk_bytes].ljust(self.chunk_bytes, b"\0")
        self._buf[base : base + self.chunk_bytes] = content


def open_untracked(name: str, *, create: bool = False, size: int = 0) -> SharedMemory:
    """Map segment `name`, or with `create` make it `size` bytes, without handing it to the
    resource tracker.

    Before 3.13 every SharedMemory registers with the tracker, which unlinks (and warns about)
    the segment when the registering process exits, so a reader would destroy the writer's
    ring. Unregistering afterwards is wrong too: children started by multiprocessing share the
    parent's tracker, and the reader's unregister would drop the writer's own registration.
    So the reader never registers. A segment made here is removed with `unlink_untracked`."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name, create=create, size=size, track=False)  # type: ignore[call-arg]
    with _UNTRACKED:
        register = resource_tracker.register
        resource_tracker.register = _ignore  # type: ignore[assignment]
        try:
            return SharedMemory(name, create=create, size=size)
        finally:
            resource_tracker.register = register


def unlink_untracked(name: str) -> bool:
    """Remove segment `name`'s name; False when there is none (already removed). Idempotent.
    `SharedMemory.unlink` would also tell the tracker to forget a name it was never given,
    which the tracker reports as an error."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


_UNTRACKED = threading.Lock()


def _ignore(name: str, rtype: str) -> None:
    pass
