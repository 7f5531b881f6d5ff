"""Reading a file that holds a secret, the way ssh reads a private key.

A deployment's secrets (the KV connector's `secret_file`, the cluster key) are files that only
their owner may read: anyone who reads one can speak for the deployment. So a file is refused
when it is not a regular file, when its group or others may read or write it, or when it belongs
to a user other than this one (or root), and at most `limit` bytes of it are read, whatever it
claims to hold.
"""

from __future__ import annotations

import os
import stat


def read_private_file(
    path: str | os.PathLike[str], *, limit: int, what: str, how: str, error: type[ValueError]
) -> bytes:
    """The content of `path`, at most `limit` bytes. Raises `error`, with a one-line message
    that starts with `what` and the path and ends with `how` (what to do about it), for a file
    that cannot be opened, is not a regular file, is open to group or others, belongs to
    another user, or holds more than `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise error(f"{what} {path}: {e.strerror}; {how}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {path} is not a regular file; {how}")
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise error(
                f"{what} {path} is accessible by group or others (mode {mode:04o}); "
                f"chmod 600 {path}"
            )
        if info.st_uid not in (os.geteuid(), 0):
            raise error(f"{what} {path} belongs to another user; {how}")
        data = b""
        while len(data) <= limit and (more := os.read(fd, limit + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{what} {path} is over {limit} bytes; {how}")
    return data
