"""The in-process model's thread: one long-lived thread that runs every call touching the model
(loading it, steps, operations), one at a time in the order given.

`run` hands a call over at once, with no checkpoint before it, and then waits for its result.
So what the trio side does next (the publisher encoding and sending the last step's outputs,
requests coming in) happens while the model computes, not before the step starts, as it could
after `trio.to_thread.run_sync`, whose limiter is a checkpoint of its own. One thread also
keeps the model's OpenMP team, and the kernels' per-thread buffers, on one master thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str = "model") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """`fn(*args)` on the thread, after the calls handed over before it. Cancelled, it
        waits for the call to end (a step or an operation half done would leave the model in
        between) and the cancellation takes effect at the next checkpoint; with
        `abandon_on_cancel` it returns at once and the call's result is dropped."""
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()
        abandoned = False

        def deliver(result: outcome.Outcome[T]) -> None:  # on the trio thread
            if not abandoned:
                trio.lowlevel.reschedule(task, result)

        def job() -> None:
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass  # the caller's trio run has ended: nobody waits for it

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal abandoned
            if not abandon_on_cancel:
                return trio.lowlevel.Abort.FAILED
            abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED

        self._jobs.put(job)
        return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]

    def start(self, fn: Callable[..., T], *args: Any) -> Pending[T]:
        """`fn(*args)` on the thread, after the calls handed over before it, without waiting:
        its result is awaited apart (`Pending.result`), so the caller can hand over the next
        call while this one runs. No checkpoint."""
        pending: Pending[T] = Pending()
        token = trio.lowlevel.current_trio_token()

        def job() -> None:
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(pending.settle, result)
            except trio.RunFinishedError:
                pass  # the caller's trio run has ended: nobody waits for it

        self._jobs.put(job)
        return pending

    def close(self, *, wait: bool = True) -> None:
        """End the thread once the calls handed over have run, and (`wait`) wait for that."""
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class Pending(Generic[T]):
    """A call handed to the model's thread by `ModelThread.start`, and in time its result."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._result: outcome.Outcome[T] | None = None

    def settle(self, result: outcome.Outcome[T]) -> None:
        self._result = result
        self._done.set()

    async def result(self) -> T:
        """The call's return value, or its exception, once it ran. A checkpoint; cancelled,
        the call goes on and its result is dropped."""
        await self._done.wait()
        assert self._result is not None
        return self._result.unwrap()
