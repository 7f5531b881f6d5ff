"""The wire benchmark's table: its rows (`Result`), one block per section with each target and
its verdict, and the percentiles of the round trips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CODEC = "codec"
TRANSPORT = "transport"
_HEADERS = {
    CODEC: ("Codec: encode+decode per message", "msgspec µs", "pickle µs", "pickle/msgspec"),
    TRANSPORT: (
        "Transport over ipc:// (echo peer process)",
        "trio adapter",
        "raw pyzmq",
        "trio/raw",
    ),
}


@dataclass(frozen=True)
class Result:
    """One table row: the same measurement for the two contenders and their ratio.

    `first` is msgspec or the trio adapter, `second` pickle or raw pyzmq. `ratio` is oriented so
    that bigger favours `first` for the codec and throughput; for latency it is trio/raw as is.
    """

    section: str
    name: str
    first: float
    second: float
    ratio: float
    target: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def format_table(results: Sequence[Result], notes: dict[str, list[str]]) -> str:
    """Aligned plain-text table, one block per section, with each target and its verdict."""
    label_width = max(len(r.name) for r in results)
    lines: list[str] = []
    for section, (title, first, second, ratio) in _HEADERS.items():
        rows = [r for r in results if r.section == section]
        if not rows:
            continue
        cells = [
            [r.name, _num(r.first), _num(r.second), f"{r.ratio:.2f}x", *_verdict(r)] for r in rows
        ]
        header = ["", first, second, ratio, "target", ""]
        widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
        widths[0] = max(widths[0], label_width)
        lines.append(title)
        lines += [f"  {note}" for note in notes.get(section, [])]
        for cell in [header, *cells]:
            left = cell[0].ljust(widths[0])
            right = "  ".join(c.rjust(w) for c, w in zip(cell[1:5], widths[1:5], strict=True))
            lines.append(f"  {left}  {right}  {cell[5]}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip()


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _verdict(r: Result) -> list[str]:
    if r.target is None:
        return ["", ""]
    return [f">= {r.target:g}x", "MET" if r.met else "NOT MET"]
