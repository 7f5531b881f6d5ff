"""The embedding API from asyncio: the guest-mode bridge, then a real engine on tiny-random.

Each test is a sync function that runs its asyncio program with `asyncio.run`, as a user's
program would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
from processes import alive

from triode.actors import RequestOutput, SamplingParams
from triode.actors import open_engine as open_trio_engine
from triode.actors.asyncio import OUTPUTS_IN_FLIGHT, AsyncioEngine, open_bridge, open_engine

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 2048}
PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)


# The bridge alone


def test_cancelling_the_asyncio_task_cancels_the_trio_call_after_its_cleanup() -> None:
    seen: list[str] = []

    async def trio_side() -> None:
        try:
            await trio.sleep_forever()
        finally:
            seen.append("cancelled")
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)
            seen.append("cleaned up")

    async def main() -> None:
        async with open_bridge() as bridge:
            task = asyncio.create_task(bridge.run(trio_side))
            await bridge.run(trio.testing.wait_all_tasks_blocked)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert seen == ["cancelled", "cleaned up"]

    asyncio.run(main())


def test_a_trio_exception_is_raised_in_asyncio_and_values_come_back() -> None:
    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("from trio")

    async def main() -> None:
        async with open_bridge() as bridge:
            assert await bridge.run(trio.to_thread.run_sync, lambda: 42) == 42
            with pytest.raises(KeyError, match="from trio"):
                await bridge.run(fails)

    asyncio.run(main())


def test_cancelling_trio_code_cancels_the_asyncio_task_it_awaits() -> None:
    async def main() -> None:
        asyncio_side = asyncio.Event()

        async def waits() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                asyncio_side.set()

        async def trio_side(bridge: Any) -> bool:
            with trio.move_on_after(0.01) as scope:
                await bridge.run_asyncio(waits)
            return scope.cancelled_caught

        async with open_bridge() as bridge:
            assert await bridge.run(trio_side, bridge)
            assert asyncio_side.is_set()

    asyncio.run(main())


def test_blocks_of_one_loop_share_one_guest_run_and_the_last_one_ends_it() -> None:
    async def main() -> None:
        async with open_bridge() as outer:
            async with open_bridge() as inner:
                assert inner is outer
            await outer.run(trio.lowlevel.checkpoint)  # still running
        assert not trio.lowlevel.in_trio_run()
        async with open_bridge() as again:
            assert again is not outer

    asyncio.run(main())
    asyncio.run(main())  # a later asyncio program in this thread starts afresh


class _CountingEngine:
    """Stands in for `Engine`: counts the outputs its `generate` made, and how it ended."""

    def __init__(self) -> None:
        self.made = 0
        self.ended: str | None = None

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[int]:
        try:
            while True:
                self.made += 1
                yield self.made
        finally:
            self.ended = "closed"


def test_generate_runs_a_few_outputs_ahead_and_closing_it_closes_the_trio_side() -> None:
    fake = _CountingEngine()

    async def main() -> None:
        async with open_bridge() as bridge:
            engine = AsyncioEngine(fake, bridge)  # type: ignore[arg-type]
            async with contextlib.aclosing(engine.generate("x")) as outputs:
                assert await anext(outputs) == 1
                await bridge.run(trio.testing.wait_all_tasks_blocked)
                # the channel's buffer, and one held by the producer's blocked send
                assert fake.made == 1 + OUTPUTS_IN_FLIGHT + 1
                assert fake.ended is None
            assert fake.ended == "closed"

    asyncio.run(main())


def test_a_bad_engine_argument_raises_in_asyncio() -> None:
    async def main() -> None:
        async with open_engine("tiny-random", no_such_argument=1):
            pass

    with pytest.raises(TypeError, match="no_such_argument"):
        asyncio.run(main())
    with pytest.raises(ValueError, match="dtype"):
        asyncio.run(_open_and_leave(dtype="float8"))


async def _open_and_leave(**engine_args: Any) -> None:
    async with open_engine("tiny-random", **engine_args):
        pass


# A real engine


@dataclass
class Observed:
    greedy: RequestOutput
    streamed_text: str
    stats_after_cancel: dict[str, Any]
    max_model_len: int
    pid: int
    alive_after_block: bool


@pytest.fixture(scope="module")
def observed() -> Observed:
    """One asyncio program on one engine: a greedy request, the same one streamed in deltas,
    and a long request whose task is cancelled after its first outputs."""

    async def main() -> Observed:
        async with open_engine("tiny-random", **ENGINE_ARGS) as engine:
            greedy = await _last(engine, PROMPT, GREEDY)
            streamed = [
                out.outputs[0].text async for out in engine.generate(PROMPT, GREEDY, delta=True)
            ]
            yielded = 0
            two_outputs = asyncio.Event()

            async def consume() -> None:
                nonlocal yielded
                async for _ in engine.generate(PROMPT, LONG):
                    yielded += 1
                    if yielded == 2:
                        two_outputs.set()

            task = asyncio.create_task(consume())
            await two_outputs.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            stats = await engine.get_stats()
            pid, max_model_len = engine.pid, engine.max_model_len
        return Observed(greedy, "".join(streamed), stats, max_model_len, pid, alive(pid))

    return asyncio.run(main())


async def _last(engine: AsyncioEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    assert final is not None and final.finished
    return final


@pytest.fixture(scope="module")
def trio_reference() -> RequestOutput:
    async def main() -> RequestOutput:
        async with open_trio_engine("tiny-random", **ENGINE_ARGS) as engine:
            final = None
            async for out in engine.generate(PROMPT, GREEDY):
                final = out
            assert final is not None
            return final

    return trio.run(main)


@pytest.mark.slow
def test_greedy_output_from_asyncio_equals_the_trio_apis(
    observed: Observed, trio_reference: RequestOutput
) -> None:
    got, want = observed.greedy.outputs[0], trio_reference.outputs[0]
    assert len(got.token_ids) == GREEDY.max_tokens
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )
    assert observed.streamed_text == want.text
    assert observed.max_model_len == ENGINE_ARGS["max_model_len"]


@pytest.mark.slow
def test_cancelling_the_consuming_task_aborts_the_request_and_frees_its_blocks(
    observed: Observed,
) -> None:
    # asked right after the cancelled task ended, long before the request could have finished
    stats = observed.stats_after_cancel
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.slow
def test_leaving_the_block_stops_the_engine_process(observed: Observed) -> None:
    assert not observed.alive_after_block
