"""`/health`'s stall check (edge/health.py), on virtual time against a fake engine."""

from __future__ import annotations

import math

import trio

from triode.actors import EngineDeadError
from triode.edge.health import ANSWER_TIMEOUT, HealthProbe


class FakeEngine:
    def __init__(self) -> None:
        self.stalled: float | None = 0.0  # None: the engine core does not answer
        self.dead = False

    async def seconds_stalled(self) -> float:
        if self.dead:
            raise EngineDeadError("gone")
        if self.stalled is None:
            await trio.sleep(math.inf)
        assert self.stalled is not None
        return self.stalled


async def test_an_engine_core_stepping_or_idle_is_healthy(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine()
    probe = HealthProbe(engine, stall_timeout=60)
    assert await probe.problem() is None
    engine.stalled = 59.0
    assert await probe.problem() is None


async def test_no_step_past_the_timeout_with_work_pending_is_a_problem(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeEngine()
    engine.stalled = 61.0
    problem = await HealthProbe(engine, stall_timeout=60).problem()
    assert problem is not None and "no step for 61 s" in problem


async def test_an_engine_core_that_stops_answering_is_a_problem_only_past_the_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = FakeEngine()
    probe = HealthProbe(engine, stall_timeout=60)
    assert await probe.problem() is None  # answered: the silence counts from here
    engine.stalled = None
    start = trio.current_time()
    assert await probe.problem() is None  # one slow answer is not a stall
    assert trio.current_time() - start == ANSWER_TIMEOUT  # /health does not hang
    await trio.sleep(60)
    problem = await probe.problem()
    assert problem is not None and "has not answered" in problem
    engine.stalled = 0.0
    assert await probe.problem() is None


async def test_a_dead_engine_is_a_problem(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine()
    engine.dead = True
    assert await HealthProbe(engine, stall_timeout=60).problem() == "the engine is not running"
