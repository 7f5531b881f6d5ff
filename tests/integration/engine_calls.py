"""What the integration tests ask of an `Engine` directly."""

from __future__ import annotations

from typing import Any

from shared_engine import stats_when

from triode.actors import Engine, RequestOutput, SamplingParams


async def final_output(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """Generate for `prompt` to the end; the last, finished output."""
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    assert final is not None and final.finished
    return final


async def waiting(engine: Engine, count: int = 1) -> dict[str, Any]:
    """The engine's stats once `count` requests wait in its queue (within 10 s): what a test
    checks before it says that they were not run."""
    return await stats_when(engine, lambda stats: stats["num_waiting_reqs"] >= count)
