"""What the integration tests ask of an `Engine` directly."""

from __future__ import annotations

from typing import Any

import trio

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
    with trio.fail_after(10):
        while True:
            stats = await engine.get_stats()
            if stats["num_waiting_reqs"] >= count:
                return stats
            await trio.sleep(0.01)
