"""The in-process model's thread: calls run one at a time, in order, on one thread that is not
the trio loop's; the call starts before the caller's next checkpoint; cancelling waits for the
call, or abandons it when asked; the thread ends when closed."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from triode.actors.core.model_thread import ModelThread


@pytest.fixture
def model_thread():  # type: ignore[no-untyped-def]
    thread = ModelThread(name="test-model")
    yield thread
    thread.close()
    assert not thread._thread.is_alive()


async def test_calls_run_in_order_on_one_thread_beside_the_loop(model_thread: ModelThread) -> None:
    ran: list[tuple[int, int]] = []

    def call(i: int) -> int:
        time.sleep(0.01)
        ran.append((i, threading.get_ident()))
        return i * i

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        results: list[int] = []

        async def caller(i: int) -> None:
            results.append(await model_thread.run(call, i))

        async with trio.open_nursery() as callers:
            for i in range(5):
                callers.start_soon(caller, i)
                await trio.lowlevel.checkpoint()  # handed over in this order
        nursery.cancel_scope.cancel()
    assert [i for i, _ in ran] == list(range(5)) and sorted(results) == [0, 1, 4, 9, 16]
    (thread,) = {ident for _, ident in ran}
    assert thread != threading.get_ident()
    assert ticks > 10  # the loop ran while the calls did


async def test_a_call_starts_before_the_callers_next_checkpoint(model_thread: ModelThread) -> None:
    # the publisher's case: a task made runnable just before the hand-over runs after the call
    # was handed over, so the call runs while that task keeps the loop's thread busy
    started = threading.Event()
    seen: list[bool] = []

    def step() -> None:
        started.set()
        time.sleep(0.05)

    async def publisher(ready: trio.Event) -> None:
        await ready.wait()
        time.sleep(0.05)  # noqa: ASYNC251 (encoding and sending: the loop's thread busy)
        seen.append(started.is_set())

    async with trio.open_nursery() as nursery:
        ready = trio.Event()
        nursery.start_soon(publisher, ready)
        await trio.sleep(0.01)  # the publisher waits
        ready.set()  # runnable now, but the step loop does not yield before the hand-over
        await model_thread.run(step)
    assert seen == [True]


async def test_an_error_reaches_the_caller_and_the_thread_goes_on(
    model_thread: ModelThread,
) -> None:
    def fail() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await model_thread.run(fail)
    assert await model_thread.run(lambda: 7) == 7


async def test_cancelling_waits_for_the_call_unless_it_may_be_abandoned(
    model_thread: ModelThread,
) -> None:
    done: list[str] = []

    def slow(name: str) -> str:
        time.sleep(0.3)
        done.append(name)
        return name

    got: list[str] = []
    with trio.move_on_after(0.05) as scope:
        got.append(await model_thread.run(slow, "waited"))  # the cancel waits for it
        await trio.lowlevel.checkpoint()  # and takes effect here
    assert scope.cancelled_caught and got == done == ["waited"]
    started = trio.current_time()
    with trio.move_on_after(0.05):
        await model_thread.run(slow, "abandoned", abandon_on_cancel=True)
    assert trio.current_time() - started < 0.25 and done == ["waited"]
    assert await model_thread.run(lambda: "next") == "next"  # after the abandoned one ends
    assert done == ["waited", "abandoned"]


async def test_started_calls_run_in_order_while_the_caller_goes_on(
    model_thread: ModelThread,
) -> None:
    gate = threading.Event()
    ran: list[int] = []

    def call(i: int) -> int:
        gate.wait(5)
        ran.append(i)
        if i == 2:
            raise ValueError("two")
        return i * 10

    first = model_thread.start(call, 1)
    second = model_thread.start(call, 2)
    assert ran == []  # handed over, not waited for: the caller went on
    gate.set()
    with pytest.raises(ValueError, match="two"):
        await second.result()
    assert await first.result() == 10
    assert ran == [1, 2]
