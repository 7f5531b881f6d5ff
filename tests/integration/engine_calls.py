"""What the integration tests ask of an `Engine` directly."""

from __future__ import annotations

from triode.actors import Engine, RequestOutput, SamplingParams


async def final_output(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """Generate for `prompt` to the end; the last, finished output."""
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    assert final is not None and final.finished
    return final
