"""A process this one depends on but did not start (an engine core, seen from an API server
that the same parent started), watched through its pidfd so that its death is noticed at once.
It offers what `EngineCoreClient` reads of a `Child`: `pid`, `exited` and `error`."""

from __future__ import annotations

import os

import trio

from .errors import ActorDied


class Peer:
    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.exited = trio.Event()
        self.error: ActorDied | None = None

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    async def watch(self) -> None:
        """Return once the process is gone (at once if it already is); sets `exited`."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pass
        else:
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        self.error = ActorDied(self.name, None)
        self.exited.set()
