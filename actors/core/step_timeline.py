"""While profiling, the engine core's own steps as Chrome trace events, beside the ranks' torch
profiles (`operations.EngineOperations.start_profile`)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from triode.wire.step import SchedulerOutput

# the most steps one profile's timeline keeps (a profile left running must not grow without
# bound): about 30 MB of trace
MAX_TIMELINE_STEPS = 200_000


class StepTimeline:
    """While profiling, the engine core's steps as Chrome trace events: when each was
    scheduled and published, its requests and tokens."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] | None = None
        self.dropped = 0
        self.started = 0  # profiles started so far: the running one's number
        self._scheduled: dict[int, float] = {}

    @property
    def running(self) -> bool:
        return self.events is not None

    def start(self) -> None:
        self.events, self.dropped = [], 0
        self.started += 1

    def scheduled(self, out: SchedulerOutput) -> None:
        if self.events is not None:
            self._scheduled[out.step] = time.time()

    def done(self, out: SchedulerOutput) -> None:
        started = self._scheduled.pop(out.step, None)
        if self.events is None or started is None:
            return
        if len(self.events) >= MAX_TIMELINE_STEPS:
            self.dropped += 1
            return
        self.events.append(
            {
                "name": "step",
                "ph": "X",
                "ts": started * 1e6,
                "dur": (time.time() - started) * 1e6,
                "pid": os.getpid(),
                "tid": 0,
                "args": {
                    "step": out.step,
                    "requests": len(out.requests),
                    "tokens": out.num_scheduled_tokens,
                },
            }
        )

    def stop(self, path: Path) -> None:
        """Write the trace to `path` and stop recording."""
        events, self.events = self.events or [], None
        self._scheduled.clear()
        trace = {"traceEvents": events, "otherData": {"dropped_steps": self.dropped}}
        # a file of its own (O_EXCL): a link someone left at a fixed name is not written through
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(trace))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
