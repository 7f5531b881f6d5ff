"""The processes under test, as the live fuzzer watches them from outside (through /proc):
whether one runs, its children, and a watch on their resident memory after warm-up."""

from __future__ import annotations

from pathlib import Path

# Resident memory may grow this much over its post-warm-up value before it counts as a leak.
RSS_GROWTH_FACTOR = 1.5
RSS_GROWTH_SLACK = 200 << 20


def rss_bytes(pid: int) -> int | None:
    """The resident set size of `pid` (VmRSS), or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (exists and is not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    """The children of `pid`, started by any of its threads."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    pids = []
    for task in tasks:
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


class MemoryWatch:
    """Resident memory of named processes against their post-warm-up values."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.baseline: dict[str, int] = {}

    def settle(self) -> None:
        """Take the current sizes as the baseline (call once warmed up)."""
        self.baseline = {n: r for n, p in self.pids.items() if (r := rss_bytes(p)) is not None}

    def check(self) -> str | None:
        """A description of the first process past its bound, or None."""
        for name, base in self.baseline.items():
            now = rss_bytes(self.pids[name])
            bound = RSS_GROWTH_FACTOR * base + RSS_GROWTH_SLACK
            if now is not None and now > bound:
                return (
                    f"{name} (pid {self.pids[name]}) grew from {base >> 20} MiB to "
                    f"{now >> 20} MiB after warm-up (bound {int(bound) >> 20} MiB)"
                )
        return None

    def describe(self) -> str:
        sizes = {n: rss_bytes(p) for n, p in self.pids.items()}
        return ", ".join(
            f"{n} {self.baseline.get(n, 0) >> 20}->{(s or 0) >> 20} MiB" for n, s in sizes.items()
        )
