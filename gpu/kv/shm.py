"""The shared-memory transport's hand-off: a prefill rank's cache in a memfd, passed to a reader
on the same host over a unix socket (SCM_RIGHTS) and to no one else.

A reader maps only memory the producer hands it. The producer's socket lives in a directory of
its own (`mkdtemp`, mode 0700, under `$XDG_RUNTIME_DIR` or the temporary directory), so only its
user can connect; the reader checks that directory before it connects, the producer checks the
peer's uid (SO_PEERCRED) and the request's MAC before it sends the fd, and the reader checks
what it got (a memfd of exactly the cache's size, sealed at that size) before it maps it. Nothing
here opens a path or a `/proc/<pid>/fd/<fd>` that a peer named.

One request per connection: a 4-byte little-endian length and a msgpack `KVRequest`; the answer
is the same framing around a `KVReply`, the fd riding on its first byte when the reply is "ok".
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 20  # a KVRequest names block ids; anything larger is hostile
CONNECTION_TIMEOUT = 2.0  # seconds one reader may take to send its request
_LENGTH = struct.Struct("<I")
_POLL_S = 0.05  # how often the serving thread looks at its stop flag
_SOCKET_NAME = "cache.sock"
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class HandoffError(Exception):
    """The hand-off failed; `protocol` when the producer's answer or fd was not a cache's."""

    def __init__(self, message: str, *, protocol: bool = False) -> None:
        super().__init__(message)
        self.protocol = protocol


def shared_cache(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor in a fresh memfd, and the fd, which the process keeps open."""
    numel = 1
    for n in shape:
        numel *= n
    fd = os.memfd_create("triode-kv-cache", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, numel * dtype.itemsize)
    # a reader maps the whole size: no one may shrink it under the reader (a SIGBUS)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
    tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    return tensor.view(shape), fd


def private_dir() -> str:
    """A fresh directory only this user can enter: under `$XDG_RUNTIME_DIR` when that is a
    directory of ours, else under the temporary directory."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not _owned_private(base, exact_mode=False):
        base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="triode-kv-", dir=base)  # mode 0700


def _owned_private(path: str, *, exact_mode: bool) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    mode = stat.S_IMODE(info.st_mode)
    return mode == 0o700 if exact_mode else not mode & 0o022


class CacheHandoff:
    """Serves one cache's memfd on a unix socket to the readers that `authorize` accepts.

    `authorize(frame)` gets a request's bytes and returns (the reply's bytes, whether to send
    the fd with it), counting what it refuses; `refuse(why)` counts the connections refused
    before that (another user's, a frame too large or never whole, a peer gone).

    Who can reach it: this user's processes on this host (the directory's mode). The largest
    input it takes is one frame of `MAX_FRAME_BYTES`, from one connection at a time, each
    given `CONNECTION_TIMEOUT` seconds.
    """

    def __init__(
        self,
        fd: int,
        authorize: Callable[[bytes], tuple[bytes, bool]],
        refuse: Callable[[str], None],
    ) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self._authorize = authorize
        self._refuse = refuse
        self._dir = private_dir()
        self.path = os.path.join(self._dir, _SOCKET_NAME)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.path)
        self._socket.listen(64)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-shm-handoff", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._socket], [], [], _POLL_S)
                if not ready:
                    continue
                connection, _ = self._socket.accept()
            except OSError as e:
                log.warning("the KV cache hand-off could not accept: %s", e)
                time.sleep(_POLL_S)
                continue
            with connection:
                try:
                    self._answer(connection)
                except Exception as e:  # a peer's doing or ours: the thread serves on
                    self._refuse(f"a KV cache hand-off: {e}")

    def _answer(self, connection: socket.socket) -> None:
        uid = _peer_uid(connection)
        if uid != os.getuid():
            raise HandoffError(f"a connection from uid {uid}, not this process's")
        connection.settimeout(CONNECTION_TIMEOUT)
        deadline = time.monotonic() + CONNECTION_TIMEOUT
        frame = _recv_frame(connection, deadline)
        reply, grant = self._authorize(frame)
        data = _LENGTH.pack(len(reply)) + reply
        if grant:
            socket.send_fds(connection, [data], [self.fd])
        else:
            connection.sendall(data)


def _peer_uid(connection: socket.socket) -> int:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid


def _recv_exact(connection: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        connection.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = connection.recv(min(n - got, 1 << 16))
        if not chunk:
            raise HandoffError(f"the peer closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(connection: socket.socket, deadline: float) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exact(connection, _LENGTH.size, deadline))
    if length > MAX_FRAME_BYTES:
        raise HandoffError(f"a frame of {length} bytes, more than {MAX_FRAME_BYTES}")
    return _recv_exact(connection, length, deadline)


def receive_cache(
    path: str, request: bytes, size: int, deadline: float
) -> tuple[bytes, int | None]:
    """Ask the hand-off at `path` for its cache: (the reply's bytes, the memfd when granted).

    The fd is checked to be a memfd of exactly `size` bytes; the caller closes it. Refused
    (`HandoffError`) before connecting: a path outside a directory of this user's with mode
    0700, or a socket that is not this user's."""
    directory = os.path.dirname(path)
    if not os.path.isabs(path) or not _owned_private(directory, exact_mode=True):
        raise HandoffError(
            f"{path!r} is not in a private directory of this user's (mode 0700)", protocol=True
        )
    try:
        info = os.lstat(path)
    except OSError as e:
        raise HandoffError(f"cannot reach the prefill's cache at {path}: {e}") from e
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise HandoffError(f"{path} is not a socket of this user's", protocol=True)
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(max(0.001, deadline - time.monotonic()))
            connection.connect(path)
            connection.sendall(_LENGTH.pack(len(request)) + request)
            connection.settimeout(max(0.001, deadline - time.monotonic()))
            head, fds, flags, _ = socket.recv_fds(connection, _LENGTH.size, 1)
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise HandoffError("the hand-off sent more than one fd", protocol=True)
            head += _recv_exact(connection, _LENGTH.size - len(head), deadline)
            (length,) = _LENGTH.unpack(head)
            if length > MAX_FRAME_BYTES:
                raise HandoffError(f"a reply of {length} bytes", protocol=True)
            reply = _recv_exact(connection, length, deadline)
    except (OSError, HandoffError) as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, HandoffError):
            raise
        raise HandoffError(f"the hand-off at {path} failed: {e}") from e
    if not fds:
        return reply, None
    fd = fds[0]
    try:
        _check_cache_fd(fd, size)
    except HandoffError:
        os.close(fd)
        raise
    return reply, fd


def _check_cache_fd(fd: int, size: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        raise HandoffError(
            f"the handed fd is not a cache of {size} bytes ({info.st_size} bytes, "
            f"mode {info.st_mode:o})",
            protocol=True,
        )
    try:  # only a memfd has seals; these keep its size what was just checked
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SIZE_SEALS != _SIZE_SEALS:
        raise HandoffError("the handed fd is not a memfd sealed at its size", protocol=True)


def map_blocks(
    fd: int, shape: tuple[int, ...], dtype: torch.dtype, block_ids: list[int]
) -> torch.Tensor:
    """The blocks `block_ids` (dim 2 of `shape`), gathered out of a private (copy-on-write)
    mapping of the cache in `fd`; the ids must be within the cache."""
    numel = 1
    for n in shape:
        numel *= n
    remote = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=numel, dtype=dtype)
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return remote.view(shape).index_select(2, ids)
