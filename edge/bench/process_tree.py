"""A server's whole process tree, found through `/proc`: its memory and its end.

A server's children need not stay in its session or process group (triode's engine core runs
in a session of its own, a fork server's children are the fork server's), so the tree is what
`/proc/*/stat` says: the root and every process whose parent is in the tree. `ProcessTree`
remembers each member it has seen with its start time, so that `end` signals only those
processes and never one that took a dead member's pid.

Memory is the sum of the members' resident sets (`VmRSS`): pages that several members share
(a forked child's copy-on-write pages, shared libraries) count once per member, so the sum is
an upper bound of what the tree holds.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio

PROC = Path("/proc")


def _stat_fields(pid: int | str) -> list[str] | None:
    """`/proc/PID/stat`'s fields after the name (the state first), None if `pid` is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold anything


def _stat(pid: int | str) -> tuple[int, int, bool] | None:
    """(parent pid, start time in clock ticks, whether it has exited) of `pid`, None if it is
    gone (an exited process stays until its parent reaps it)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), int(fields[19]), fields[0] in ("Z", "X")


def cpu_ticks(pid: int) -> int:
    """User and system CPU time `pid` has used, in clock ticks; 0 if it is gone."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU of the machine since boot, from /proc/stat."""
    values = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = values
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _rss_bytes(pid: int) -> int:
    """`pid`'s resident set in bytes; 0 if it is gone (or a zombie, which has none)."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class ProcessTree:
    """The processes descended from `root`, as of the last `scan`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}  # pid: start time, of every member ever scanned
        self.members: list[int] = []

    def scan(self) -> list[int]:
        """The live members now: the root and its descendants (the root's own entry while it
        lives)."""
        children: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for entry in PROC.iterdir():
            if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
                pid = int(entry.name)
                children.setdefault(stat[0], []).append(pid)
                starts[pid] = stat[1]
        members = [self.root] if self.root in starts else []
        for pid in members:  # grows as it goes: breadth first
            members += children.get(pid, [])
        for pid in members:
            self.seen.setdefault(pid, starts[pid])
        self.members = members
        return members

    def rss_bytes(self) -> int:
        """The sum of the live members' resident sets, after a new `scan`."""
        return sum(_rss_bytes(pid) for pid in self.scan())

    def cpu_ticks(self) -> int:
        """The CPU time its live members have used, in clock ticks, after a new `scan`."""
        return sum(cpu_ticks(pid) for pid in self.scan())

    def still_running(self) -> list[int]:
        """Every process ever seen in the tree that still runs: the same process (the same pid
        and start time), not exited."""
        return [
            pid
            for pid, start in self.seen.items()
            if (stat := _stat(pid)) is not None and stat[1] == start and not stat[2]
        ]

    def end(self) -> list[int]:
        """SIGKILL every process ever seen in the tree that still runs; the pids signalled."""
        ended = []
        for pid in self.still_running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it ended between the two looks
            ended.append(pid)
        return ended


class PeakMemory:
    """The highest `ProcessTree.rss_bytes` seen per phase (`start`, then a name per load)."""

    def __init__(self, tree: ProcessTree) -> None:
        self.tree = tree
        self.phase = "start"
        self.peaks: dict[str, int] = {}

    def sample(self) -> None:
        rss = self.tree.rss_bytes()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    async def run(self, interval: float = 0.25) -> None:
        """Sample every `interval` seconds until cancelled (cancelling ends it; nothing is
        lost: each sample is recorded as it is taken)."""
        while True:
            self.sample()
            await trio.sleep(interval)
