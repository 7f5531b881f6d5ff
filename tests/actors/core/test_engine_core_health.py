"""The engine core's own account of a stall (`seconds_stalled`, what `/health` asks), with a
scripted executor on virtual time: only time without a step while requests wait counts."""

from __future__ import annotations

from typing import Any

import trio

from triode.actors.core.engine_core import EngineCore
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import EngineCoreRequest, SamplingParams
from triode.wire.step import ModelRunnerOutput, RequestStepResult, SchedulerOutput


class ScriptedExecutor:
    """Answers each step with token 1 for every request, or hangs from `stick` to `free`."""

    max_concurrent_batches = 1

    def __init__(self) -> None:
        self.freed = trio.Event()
        self.freed.set()
        self.steps = 0

    def stick(self) -> None:
        self.freed = trio.Event()

    def free(self) -> None:
        self.freed.set()

    async def execute(self, out: SchedulerOutput, fill_bitmask: Any) -> ModelRunnerOutput:
        await self.freed.wait()
        self.steps += 1
        await trio.sleep(0.01)
        return ModelRunnerOutput(
            out.step, [RequestStepResult(r.request_id, token_id=1) for r in out.requests]
        )


async def _add(core: EngineCore, request_id: str, max_tokens: int) -> None:
    request = EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    assert core.scheduler.add_request(request) is None
    core._work.set()


async def test_only_time_without_a_step_while_requests_wait_counts_as_a_stall(
    autojump_clock: trio.abc.Clock,
) -> None:
    config = SchedulerConfig(num_blocks=600, block_size=4, max_model_len=2048)
    executor = ScriptedExecutor()
    core = EngineCore(Scheduler(config), executor)  # type: ignore[arg-type]
    core._progress_at = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(core._step_loop)
        nursery.start_soon(_drain, core)
        await trio.sleep(100)  # idle: no request, no stall
        assert core.seconds_stalled() == 0.0
        executor.stick()
        await _add(core, "a", max_tokens=2000)
        await trio.sleep(30)  # work waits, and no step comes: counted from its arrival
        assert 29 < core.seconds_stalled() < 31
        executor.free()
        await trio.sleep(5)  # stepping: no stall
        assert executor.steps > 100 and core.seconds_stalled() < 1
        executor.stick()
        await trio.sleep(90)
        assert 89 < core.seconds_stalled() < 91
        core.holds.add("sleep")  # told to take no steps: not a stall
        assert core.seconds_stalled() == 0.0
        core.holds.discard("sleep")
        executor.free()
        await trio.sleep(5)
        assert core.seconds_stalled() < 1
        nursery.cancel_scope.cancel()


async def _drain(core: EngineCore) -> None:
    async for _ in core._publisher_inbox:
        pass
