"""What a live fuzzing run reports: the `Report` of one mode (what it sent, what came back, the
violations), the `Violation` that stops a run, and fresh paths for the crash files that hold
what triggered one (under `fuzz/crashes/`)."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CRASH_DIR = Path(__file__).resolve().parents[1] / "crashes"


class Violation(Exception):
    """An invariant broke. `reproducer` is the file (or folder) holding what triggered it."""

    def __init__(self, message: str, reproducer: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reproducer = reproducer


@dataclass
class Report:
    """What one mode sent and saw."""

    mode: str
    seed: int
    sent: Counter[str] = field(default_factory=Counter)  # by kind of mutation
    outcomes: Counter[str] = field(default_factory=Counter)  # HTTP status, or ZMQ outcome
    protocol_errors: int = 0  # undecodable frames the engine counted (ZMQ)
    rounds: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    replay: str = ""  # the command that replays the first violation
    engine: dict[str, Any] = field(default_factory=dict)  # its last stats (ZMQ)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def rate(self) -> float:
        return self.total / self.seconds if self.seconds else math.nan

    def format(self) -> str:
        unit = "requests" if self.mode == "http" else "messages"
        lines = [
            f"live fuzz {self.mode} (seed {self.seed}): {self.total} {unit} in {self.rounds} "
            f"rounds, {self.seconds:.1f} s, {self.rate:.0f}/s",
            "  sent by kind: " + _counts(self.sent),
            ("  status codes: " if self.mode == "http" else "  outcomes: ")
            + _counts(self.outcomes),
        ]
        if self.mode == "zmq":
            lines.append(f"  protocol errors counted by the engine: {self.protocol_errors}")
            lines.append("  engine: " + ", ".join(f"{k} {v}" for k, v in self.engine.items()))
        lines.append(f"  violations: {len(self.violations)}")
        lines += [f"    {v}" for v in self.violations]
        if self.replay:
            lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1]))


def crash_path(name: str, directory: Path | None = None) -> Path:
    """A fresh path for a reproducer named `name` under `directory` (default `fuzz/crashes/`)."""
    directory = directory or CRASH_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = directory / f"{name}-{stamp}"
    n = 0
    while path.exists():
        n += 1
        path = directory / f"{name}-{stamp}-{n}"
    return path
