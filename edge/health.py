"""What `/health` says beyond "the engine is running": whether its engine cores still step.

An engine core whose step loop is stuck (a forward that never returns, a collective waiting on
a peer that is gone) is alive to its supervisor and would answer every request by never
answering. `/health` asks the engine cores how long they have made no step while they had
requests to work on, and is a 503 past `Settings.health_stall_timeout`. An engine core that
does not answer within `ANSWER_TIMEOUT` counts as stalled since it last answered, so one slow
answer under load does not make the server unhealthy, but a loop that stopped does.
"""

from __future__ import annotations

from typing import Any

import trio

from triode.actors import EngineDeadError

# how long /health waits for the engine cores' answer (probes time out at 1 s by default)
ANSWER_TIMEOUT = 0.5


class HealthProbe:
    """Asks an `Engine` whether it stalled; keeps when the engine cores last answered."""

    def __init__(self, engine: Any, stall_timeout: float) -> None:
        self.engine = engine
        self.stall_timeout = stall_timeout
        self._answered_at: float | None = None  # trio's clock; None: not asked yet

    async def problem(self) -> str | None:
        """Why the engine is not healthy, or None. Waits at most `ANSWER_TIMEOUT`; cancelling
        it leaves nothing behind."""
        now = trio.current_time()
        if self._answered_at is None:
            self._answered_at = now
        stalled: float | None = None
        with trio.move_on_after(ANSWER_TIMEOUT):
            try:
                stalled = await self.engine.seconds_stalled()
            except EngineDeadError:
                return "the engine is not running"
        if stalled is None:
            silent = trio.current_time() - self._answered_at
            if silent > self.stall_timeout:
                return f"the engine core has not answered for {silent:.0f} s"
            return None
        self._answered_at = now
        if stalled > self.stall_timeout:
            return (
                f"the engine core has made no step for {stalled:.0f} s while requests wait "
                f"(at most {self.stall_timeout:g} s)"
            )
        return None
