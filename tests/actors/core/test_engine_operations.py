"""The engine core's operations as a state machine, on a scripted executor and virtual time:
what each call is refused with out of turn, an update a trainer left open, and a profile nobody
stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from triode.actors.core.engine_core import EngineCore
from triode.actors.core.operations import MAX_PROFILE_SECONDS, UPDATE_IDLE_TIMEOUT
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import EngineCoreRequest, OperationError, SamplingParams
from triode.wire.step import ModelRunnerOutput, RequestStepResult, SchedulerOutput


class Ranks:
    """One rank in this process that answers every step with token 1 and records its calls."""

    max_concurrent_batches = 1

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def execute(self, out: SchedulerOutput, fill_bitmask: Any) -> ModelRunnerOutput:
        await trio.sleep(0.01)
        return ModelRunnerOutput(
            out.step, [RequestStepResult(r.request_id, token_id=1) for r in out.requests]
        )

    async def call_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(method)
        return [{"pid": os.getpid(), "rss_bytes": 0}]


async def _conflict(call: Any) -> str:
    with pytest.raises(OperationError) as refused:
        await call
    assert refused.value.kind == "conflict"
    return refused.value.message


async def test_calls_out_of_turn_are_refused_and_an_abandoned_update_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    ranks = Ranks()
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256)
    core = EngineCore(Scheduler(config), ranks)  # type: ignore[arg-type]
    ops = core.operations
    async with trio.open_nursery() as nursery:
        core._nursery = nursery
        nursery.start_soon(core._step_loop)
        nursery.start_soon(_drain, core)

        await ops.sleep(0)
        assert "asleep" in await _conflict(ops.sleep(0))
        await ops.wake_up()
        await ops.pause("keep")
        assert "paused" in await _conflict(ops.pause("abort"))
        await ops.resume()
        assert not core.holds

        assert "init" in await _conflict(ops.start_weight_update())
        assert "start" in await _conflict(ops.update_weights({"buckets": []}))
        await ops.init_weight_transfer_engine({"backend": "shm"})
        await ops.start_weight_update()
        assert "already" in await _conflict(ops.start_weight_update())
        assert "progress" in await _conflict(ops.update_weights_from_disk("/somewhere"))
        await ops.update_weights({"buckets": []})

        # the trainer goes away: requests wait, then the engine finishes the update itself
        request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=4))
        assert core.scheduler.add_request(request) is None
        core._work.set()
        await trio.sleep(UPDATE_IDLE_TIMEOUT - 1)
        assert ops.updating and core.scheduler.has_unfinished_requests()
        await trio.sleep(2)
        assert not ops.updating and not core.holds and ops.version == 1
        await trio.sleep(1)
        assert not core.scheduler.has_unfinished_requests()
        assert ranks.calls[-1] == "finish_weight_update"
        nursery.cancel_scope.cancel()


async def _drain(core: EngineCore) -> None:
    async for _ in core._publisher_inbox:
        pass


async def test_a_profile_nobody_stops_is_stopped_and_written_through_no_planted_link(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """torch's profiler keeps every event until it stops: one left running is stopped after
    `MAX_PROFILE_SECONDS`, and only that one. Its trace is written to a file of its own, so a
    link left at a name the engine writes (another user's, in a shared directory) is replaced,
    never written through."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    folder = tmp_path / "profiles"
    folder.mkdir()
    for name in ("engine-0-steps.json", "engine-0-steps.tmp", ".engine-0-steps.json.partial"):
        (folder / name).symlink_to(victim)
    ranks = Ranks()
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256)
    core = EngineCore(Scheduler(config), ranks, profiler_dir=str(folder))  # type: ignore[arg-type]
    ops = core.operations
    async with trio.open_nursery() as nursery:
        core._nursery = nursery
        nursery.start_soon(core._step_loop)
        nursery.start_soon(_drain, core)
        await ops.start_profile()  # stopped by hand: its expiry must not stop the next one
        await trio.sleep(MAX_PROFILE_SECONDS / 2)
        await ops.stop_profile()
        await ops.start_profile()
        await trio.sleep(MAX_PROFILE_SECONDS / 2 + 1)
        assert ops.timeline.running
        await trio.sleep(MAX_PROFILE_SECONDS / 2)
        assert not ops.timeline.running
        assert ranks.calls.count("stop_profile") == 2
        nursery.cancel_scope.cancel()
    assert victim.read_text() == "untouched"
    steps = folder / "engine-0-steps.json"
    assert not steps.is_symlink() and "traceEvents" in json.loads(steps.read_text())
    assert [p.name for p in folder.glob(".*partial")] == [".engine-0-steps.json.partial"]
