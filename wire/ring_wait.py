"""How either end of the shared-memory ring (`shm_ring`) waits, and what a wait that gives up
raises.

A waiter spins with `os.sched_yield` for `SPIN_S`, then sleeps, doubling from `MIN_PAUSE_S` up
to `MAX_PAUSE_S` (`Pacer`); a reader still idle after `SLEEP_AFTER_S` blocks on its wake-up
socket instead, `POLL_SLICE_S` at a time. Between pauses every wait checks its deadline
(`RingTimeout`) and the caller's `cancelled` event (`RingClosed`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence

# A spin catches a peer that is mid-copy; the pause cap keeps a held writer at ~3% of a core;
# a reader sleeps soon, as the UDP wake-up is about as fast as the longer pauses.
SPIN_S = 50e-6
MIN_PAUSE_S = 20e-6
MAX_PAUSE_S = 1e-3
SLEEP_AFTER_S = 1e-3
POLL_SLICE_S = 0.05  # how often a blocked wait looks at `cancelled` and the closed byte


class RingTimeout(TimeoutError):
    """A wait passed its timeout; the operation did not happen. `waiting_on` names the local
    readers a writer was waiting for."""

    def __init__(self, message: str, waiting_on: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.waiting_on = tuple(waiting_on)


class RingClosed(Exception):
    """The ring was closed, or the caller's `cancelled` event was set; the operation did not
    happen."""


def deadline_after(timeout: float | None) -> float:
    return math.inf if timeout is None else time.monotonic() + timeout


def check_wait(
    deadline: float, cancelled: threading.Event | None, what: str, waiting_on: Sequence[int] = ()
) -> None:
    if cancelled is not None and cancelled.is_set():
        raise RingClosed(f"cancelled while {what}")
    if time.monotonic() >= deadline:
        raise RingTimeout(f"timed out {what}", waiting_on)


def poll_ms(deadline: float) -> int:
    return max(0, math.ceil(min(POLL_SLICE_S, deadline - time.monotonic()) * 1000))


class Pacer:
    """Spin briefly, then sleep with doubling pauses: fast when the other side is quick, cheap
    when it is not."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self._pause = MIN_PAUSE_S

    def pause(self) -> None:
        if time.monotonic() - self.start < SPIN_S:
            os.sched_yield()
            return
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, MAX_PAUSE_S)
