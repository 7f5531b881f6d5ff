"""Recordings of an engine core's wire traffic, and reading them back.

A recording is a directory: `meta.json` (what the engine was started with, and when) and record
files `wire-000001.rec`, `wire-000002.rec`, ... Each file is a magic line, then records, each a
4-byte big-endian length and one msgpack `Record`: the raw frames of one message the engine core
received ("in") or published ("out"), with the wall-clock time it did so. A file ends before a
record would take it past `max_file_bytes`, and only the newest `max_files` files are kept: a
recording stays within about `max_files * max_file_bytes` however long the engine runs.

Records go through one buffered file (1 MiB), flushed when the buffer fills and at least once a
second, so each message costs an encode and a memory copy on the trio thread and the disk is
written in large pieces. A crash loses at most the unflushed tail and may tear the last record:
the reader skips a torn last record, and raises `ProtocolError` for anything else that is not a
recording.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec
import trio

from .codec import Buffer
from .errors import ProtocolError

log = logging.getLogger(__name__)

Direction = Literal["in", "out"]

DEFAULT_MAX_FILE_BYTES = 64 << 20
DEFAULT_MAX_FILES = 8
META_FILE = "meta.json"
MAGIC = b"triode-wire-recording 1\n"
# Written in pieces this large; up to this much is lost if the process is killed.
_WRITE_BUFFER = 1 << 20
# And at least this often (seconds), so that a recording of a quiet engine is readable.
_FLUSH_INTERVAL = 1.0
_LENGTH = struct.Struct(">I")
_FILE_NAME = re.compile(r"wire-(\d{6,})\.rec")


class Record(msgspec.Struct, array_like=True, gc=False):
    """One message as it crossed the engine core's sockets."""

    timestamp: float  # time.time() when the engine core took or sent it
    direction: Direction
    frames: list[bytes]


class Recorder:
    """Appends records to the files of one recording directory. Use it from one thread.

    A write that fails (a full disk) ends the recording with an error in the log; the engine
    serves on.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ) -> None:
        if max_file_bytes <= len(MAGIC) + _LENGTH.size:
            raise ValueError(f"max_file_bytes must be > {len(MAGIC) + _LENGTH.size}")
        if max_files < 1:
            raise ValueError("max_files must be >= 1")
        self.directory = Path(directory)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.records = 0
        self.failed: OSError | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray()
        self._index = 0
        self._file: BinaryIO | None = None
        self._size = 0
        self._flushed = time.monotonic()

    def record(self, direction: Direction, frames: Sequence[Buffer]) -> None:
        """Append one message's frames, stamped with the time now."""
        # memoryviews encode to msgpack bin as bytes do: the frames are not copied first
        self.write(Record(time.time(), direction, list(frames)))  # type: ignore[arg-type]

    def write(self, record: Record) -> None:
        """Append `record` as it is (a tool that rewrites a recording keeps its times)."""
        if self.failed is not None:
            return
        buffer = self._buffer
        self._encoder.encode_into(record, buffer, _LENGTH.size)
        _LENGTH.pack_into(buffer, 0, len(buffer) - _LENGTH.size)
        try:
            if self._file is None or self._size + len(buffer) > self.max_file_bytes:
                self._rotate()
            assert self._file is not None
            self._file.write(buffer)
            self._size += len(buffer)
            now = time.monotonic()
            if now - self._flushed > _FLUSH_INTERVAL:
                self._file.flush()
                self._flushed = now
        except OSError as e:
            self.failed = e
            log.error("wire recording in %s stopped: %s", self.directory, e)
            self.close()
            return
        self.records += 1

    def close(self) -> None:
        """Flush and close the current file. Idempotent."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _rotate(self) -> None:
        """Start the next file (a record larger than a whole file gets one of its own) and
        delete those that fall out of the newest `max_files`."""
        if self._file is not None and self._size == len(MAGIC):
            return  # a fresh file: the record goes in, whatever its size
        self.close()
        self._index += 1
        self._file = open(self.directory / _file_name(self._index), "xb", buffering=_WRITE_BUFFER)
        self._file.write(MAGIC)
        self._size = len(MAGIC)
        old = self._index - self.max_files
        if old >= 1:
            (self.directory / _file_name(old)).unlink(missing_ok=True)


@asynccontextmanager
async def open_recorder(
    directory: str | os.PathLike[str],
    meta: Mapping[str, Any],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
) -> AsyncIterator[Recorder]:
    """Start a recording in `directory` (created if missing) and close it on leaving.

    `meta` (JSON-able: the engine arguments, ...) goes into `meta.json` with the start time
    under `start_time`. Raises `FileExistsError` if `directory` holds a recording already:
    recordings are never mixed or overwritten. A checkpoint on entry.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / META_FILE).exists() or record_files(directory):
        raise FileExistsError(f"{directory} holds a wire recording already; give a new directory")
    content = {**meta, "start_time": time.time()}
    (directory / META_FILE).write_text(json.dumps(content, indent=2) + "\n")
    recorder = Recorder(directory, max_file_bytes=max_file_bytes, max_files=max_files)
    await trio.lowlevel.checkpoint()
    try:
        yield recorder
    finally:
        recorder.close()


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The recording's `meta.json`. Raises `ProtocolError` if it is not a JSON object."""
    raw = (Path(directory) / META_FILE).read_bytes()
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise ProtocolError(f"{META_FILE} is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"{META_FILE} is not a JSON object")
    return meta


def read_records(directory: str | os.PathLike[str]) -> Iterator[Record]:
    """Every record of the recording in `directory`, oldest first.

    A torn last record (the writer was killed mid-write) ends the recording quietly; any other
    file content that is not records raises `ProtocolError`.
    """
    files = record_files(Path(directory))
    decoder = msgspec.msgpack.Decoder(Record)
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            yield from _read_file(f, path, decoder, last=i == len(files) - 1)


def record_files(directory: Path) -> list[Path]:
    """The directory's record files in the order they were written."""
    numbered = []
    for path in directory.glob("wire-*.rec"):
        match = _FILE_NAME.fullmatch(path.name)
        if match is not None:
            numbered.append((int(match.group(1)), path))
    return [path for _, path in sorted(numbered)]


def _read_file(
    f: BinaryIO, path: Path, decoder: msgspec.msgpack.Decoder[Record], *, last: bool
) -> Iterator[Record]:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        if last and MAGIC.startswith(magic):
            return  # created, then killed before its first flush
        raise ProtocolError(f"{path.name} is not a triode wire recording")
    file_size = os.fstat(f.fileno()).st_size
    while True:
        head = f.read(_LENGTH.size)
        if not head:
            return
        if len(head) < _LENGTH.size:
            torn = True
        else:
            (size,) = _LENGTH.unpack(head)
            # what the length claims beyond the file's end is not read (nor allocated)
            body = f.read(min(size, file_size - f.tell()))
            torn = len(body) < size
        if torn:
            if last:
                return
            raise ProtocolError(f"{path.name} ends inside a record, and a newer file follows")
        try:
            record = decoder.decode(body)
        except Exception as e:  # totality: nothing but ProtocolError leaves the reader
            raise ProtocolError(f"{path.name}: a record that does not decode: {e!r}") from None
        yield record


def _file_name(index: int) -> str:
    return f"wire-{index:06d}.rec"
