"""The chaos harness's invariants, kept while it runs and printed as a table at the end.

- every request ends exactly once: an answer, or one clear error (`chaos_load.Outcome`);
- no 5xx other than 503, and a 503 or a dropped connection only around a kill: from the kill
  until the server is healthy again, plus `GRACE` seconds;
- greedy answers equal before and after each restart (a canary prompt, and the adapters the
  operator loaded are still served);
- the process tree's resident memory has no upward trend over the last two thirds of the run:
  a least-squares line through the samples taken while no restart is under way, whose rise
  over that span must stay under `TREND_BOUND` of the mean and `TREND_SLACK`;
- once the load stops: no request running and the KV cache empty;
- once the server stops: no process of its tree and no shared-memory segment of triode's left.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .chaos_load import Outcome

# seconds after a restart's end within which its 503s and dropped connections still count
GRACE = 5.0
# the memory trend's bound: its rise over the judged span, against the span's mean
TREND_BOUND = 0.10
TREND_SLACK = 128 << 20
# the fewest samples a trend is judged on (a minute of them, at one per two seconds)
MIN_TREND_SAMPLES = 30


@dataclass
class Invariant:
    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)

    def check(self, ok: bool, why: str) -> None:
        self.checked += 1
        if not ok:
            self.violations.append(why)


class Ledger:
    """What a run saw: its requests' outcomes, its kills and restarts, memory samples, and the
    invariants judged on them."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.outcomes: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.kills: Counter[str] = Counter()
        self.operations: Counter[str] = Counter()
        self.restarts = 0
        # (from, to) of each kill until the server was healthy again (to: None while it is not)
        self.windows: list[list[float | None]] = []
        self.memory: list[tuple[float, int]] = []  # (time, bytes) outside restarts
        self.memory_trend = ""
        self.ended_once = Invariant("every request ended exactly once")
        self.no_5xx = Invariant("no 5xx but 503, none and no lost connection but around a kill")
        self.greedy = Invariant("greedy answers and adapters equal after each restart")
        self.trend = Invariant("no upward memory trend over the last two thirds")
        self.idle = Invariant("idle: no request running, KV cache empty")
        self.left = Invariant("stopped: no process and no shared memory left")

    @property
    def invariants(self) -> list[Invariant]:
        return [self.ended_once, self.no_5xx, self.greedy, self.trend, self.idle, self.left]

    @property
    def violations(self) -> list[str]:
        return [f"{i.name}: {v}" for i in self.invariants for v in i.violations]

    # while it runs

    def killed(self, victim: str) -> list[float | None]:
        self.kills[victim.rstrip("0123456789-")] += 1
        window: list[float | None] = [time.monotonic(), None]
        self.windows.append(window)
        return window

    def recovered(self, window: list[float | None]) -> None:
        window[1] = time.monotonic()

    def restarting(self, at: float) -> bool:
        return any(
            start is not None and start <= at and (end is None or at <= end + GRACE)
            for start, end in self.windows
        )

    def record(self, outcome: Outcome) -> None:
        self.outcomes[outcome.result] += 1
        if outcome.status is not None:
            self.statuses[str(outcome.status)] += 1
        where = f"{outcome.action} at {outcome.started - self.started:.1f} s"
        self.ended_once.check(outcome.result != "bad", f"{where}: {outcome.detail}")
        if outcome.result in ("error", "lost"):
            status = outcome.status
            around = any(
                self._overlaps(outcome.started, outcome.ended, start, end)
                for start, end in self.windows
            )
            said = f"{where}: {status or 'lost'} ({outcome.detail})"
            if outcome.result == "lost" or status == 503:
                self.no_5xx.check(around, f"{said} with no kill near")
            else:
                self.no_5xx.check(status is not None and status < 500, said)

    def _overlaps(self, a: float, b: float, start: float | None, end: float | None) -> bool:
        assert start is not None
        return a <= (end if end is not None else time.monotonic()) + GRACE and b >= start

    def sample_memory(self, rss: int) -> None:
        now = time.monotonic()
        if not self.restarting(now):
            self.memory.append((now, rss))

    # at the end

    def judge_memory(self) -> None:
        """A least-squares line through the last two thirds of the samples: its rise over
        their span against their mean."""
        samples = self.memory[len(self.memory) // 3 :]
        if len(samples) < MIN_TREND_SAMPLES:
            self.memory_trend = f"{len(samples)} samples: too few to judge a trend"
            return
        seconds = np.array([t for t, _ in samples]) - samples[0][0]
        sizes = np.array([float(b) for _, b in samples])
        slope, _ = np.polyfit(seconds, sizes, 1)
        rise = slope * seconds[-1]
        mean = sizes.mean()
        self.memory_trend = (
            f"{mean / 2**20:.0f} MiB mean, {slope * 60 / 2**20:+.1f} MiB/min over "
            f"{seconds[-1] / 60:.1f} min ({len(samples)} samples)"
        )
        self.trend.check(
            rise <= max(TREND_BOUND * mean, TREND_SLACK),
            f"rose {rise / 2**20:.0f} MiB over the last two thirds ({self.memory_trend})",
        )

    def table(self) -> str:
        minutes = (time.monotonic() - self.started) / 60
        total = sum(self.outcomes.values())
        lines = [
            f"chaos {self.label}: {minutes:.1f} min, {total} requests "
            f"({_counts(self.outcomes)}), statuses {_counts(self.statuses)}",
            f"  kills {sum(self.kills.values())} ({_counts(self.kills)}), engine restarts "
            f"{self.restarts}, operations {sum(self.operations.values())} "
            f"({_counts(self.operations)})",
            f"  memory of the process tree: {self.memory_trend}",
            f"  {'invariant':<66} {'checked':>8} {'violations':>10}",
        ]
        for invariant in self.invariants:
            lines.append(
                f"  {invariant.name:<66} {invariant.checked:>8} {len(invariant.violations):>10}"
            )
        lines += [f"    {v}" for v in self.violations[:20]]
        return "\n".join(lines)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1]))
