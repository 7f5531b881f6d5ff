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

A recording holds every prompt and answer the engine saw, so it is the operator's alone: the
directory is made 0700 (an existing one must be the user's own and writable by no one else, and
not a symbolic link) and each file is created 0600, new (`O_EXCL`) and never through a symbolic
link (`O_NOFOLLOW`), relative to the directory opened once, so that a path swapped afterwards
redirects nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
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
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Record(msgspec.Struct, array_like=True, gc=False):
    """One message as it crossed the engine core's sockets."""

    timestamp: float  # time.time() when the engine core took or sent it
    direction: Direction
    frames: list[bytes]


class Recorder:
    """Appends records to the files of one recording directory. Use it from one thread.

    A write that fails (a full disk) ends the recording with an error in the log; the engine
    serves on. Files are made in `dir_fd` when given (the directory `open_recorder` checked),
    else in `directory` opened at the first record; the recorder closes it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        dir_fd: int | None = None,
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
        self._dir_fd = dir_fd

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
        """Flush and close the current file and the directory. Idempotent."""
        self._close_file()
        if self._dir_fd is not None:
            fd, self._dir_fd = self._dir_fd, None
            os.close(fd)

    def _close_file(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _rotate(self) -> None:
        """Start the next file (a record larger than a whole file gets one of its own) and
        delete those that fall out of the newest `max_files`."""
        if self._file is not None and self._size == len(MAGIC):
            return  # a fresh file: the record goes in, whatever its size
        self._close_file()
        if self._dir_fd is None:
            self._dir_fd = os.open(self.directory, _DIRECTORY)
        self._index += 1
        fd = os.open(_file_name(self._index), _NEW_FILE, 0o600, dir_fd=self._dir_fd)
        self._file = os.fdopen(fd, "wb", buffering=_WRITE_BUFFER)
        self._file.write(MAGIC)
        self._size = len(MAGIC)
        old = self._index - self.max_files
        if old >= 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_file_name(old), dir_fd=self._dir_fd)


@asynccontextmanager
async def open_recorder(
    directory: str | os.PathLike[str],
    meta: Mapping[str, Any],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
) -> AsyncIterator[Recorder]:
    """Start a recording in `directory` (created 0700 with its missing parents) and close it on
    leaving.

    `meta` (JSON-able: the engine arguments, ...) goes into `meta.json` with the start time
    under `start_time`. Raises `FileExistsError` if `directory` holds a recording already:
    recordings are never mixed or overwritten; `PermissionError` if it is a symbolic link,
    another user's, or writable by group or others. A checkpoint on entry.
    """
    directory = Path(directory)
    dir_fd = open_private_directory(directory)
    try:
        names = os.listdir(dir_fd)
        if META_FILE in names or any(_FILE_NAME.fullmatch(n) for n in names):
            raise FileExistsError(
                f"{directory} holds a wire recording already; give a new directory"
            )
        content = {**meta, "start_time": time.time()}
        fd = os.open(META_FILE, _NEW_FILE, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(content, indent=2) + "\n")
    except BaseException:
        os.close(dir_fd)
        raise
    recorder = Recorder(
        directory, max_file_bytes=max_file_bytes, max_files=max_files, dir_fd=dir_fd
    )
    await trio.lowlevel.checkpoint()
    try:
        yield recorder
    finally:
        recorder.close()


def open_private_directory(directory: Path) -> int:
    """A descriptor of `directory`, made 0700 (with any missing parents) if it is missing.

    Raises `PermissionError` for a symbolic link, a directory of another user, or one that group
    or others may write (they could plant or swap files in it), and `NotADirectoryError`.
    """
    missing = [p for p in (directory, *directory.parents) if not os.path.lexists(p)]
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another engine of the same run made it
            os.mkdir(path, 0o700)
    try:
        fd = os.open(directory, _DIRECTORY)
    except OSError:
        if os.path.islink(directory):
            raise PermissionError(
                f"{directory} is a symbolic link; give the real directory to record into"
            ) from None
        raise
    info = os.fstat(fd)
    problem = None
    if info.st_uid != os.geteuid():
        problem = "belongs to another user"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"may be written by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        os.close(fd)
        raise PermissionError(f"{directory} {problem}; record into a directory of your own")
    return fd


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
