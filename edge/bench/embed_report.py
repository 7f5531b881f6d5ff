"""`triode bench embed`'s results and its table: what one contestant measured at each batch
size, how its embeddings agree with the reference's, and the rows that put them side by side."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SENTENCE_TRANSFORMERS = "sentence-transformers"
TRIODE = "triode"
TRIODE_AUTO = "triode auto"
VLLM = "vLLM"
# triode's ratio to each of these, and the ratio it is expected to reach
TARGETS = {VLLM: 1.5, SENTENCE_TRANSFORMERS: 1.0}
_SHORT = {SENTENCE_TRANSFORMERS: "ST"}
# sentences timed at batch size 1 and at larger ones, unless `--requests` says otherwise
SENTENCES_AT_ONE, SENTENCES_BATCHED = 512, 2048


@dataclass
class BatchRun:
    """One contestant's timed requests at one batch size."""

    batch: int  # sentences per request
    requests: int
    sentences: int  # embedded: those of failed requests are not counted
    seconds: float  # from the first request sent to the last answered
    p50_ms: float  # the median request's latency
    failed: int = 0
    error: str = ""  # the first failure's, where any failed

    @property
    def rate(self) -> float:
        """Sentences per second."""
        return self.sentences / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Contestant:
    """What one contestant measured: a row per batch size, or a note saying why there is none."""

    name: str
    dtype: str
    runs: dict[int, BatchRun] = field(default_factory=dict)
    start_s: float | None = None  # a server's, from its start to a healthy `/health`
    # (min, mean) cosine similarity of its embeddings to the reference's, input by input
    agreement: tuple[float, float] | None = None
    note: str = ""


def agreement(embeddings: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """The (min, mean) cosine similarity of each row of `embeddings` to the same row of
    `reference`; ValueError where their shapes differ."""
    if embeddings.shape != reference.shape:
        raise ValueError(f"embeddings of shape {embeddings.shape}, expected {reference.shape}")
    a, b = embeddings.astype(np.float64), reference.astype(np.float64)
    cosine = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cosine.min()), float(cosine.mean())


def _ratio(mine: BatchRun | None, theirs: BatchRun | None, target: float) -> str:
    if mine is None or theirs is None or not theirs.rate:
        return "-"
    ratio = mine.rate / theirs.rate
    return f"{ratio:.2f}x {'met' if ratio >= target else 'below'}"


def _rate(run: BatchRun | None) -> str:
    if run is None:
        return "-"
    failed = f" ({run.failed} failed)" if run.failed else ""
    return f"{run.rate:,.1f}{failed}"


def format_table(
    contestants: list[Contestant], args: argparse.Namespace, *, cpu: str, load: tuple[float, float]
) -> str:
    """The report: the setting, one row per batch size of `args.batch_list` (sentences per
    second, triode's ratios beside their targets, p50 latencies), then the agreement, the
    servers' start-up and why any contestant has no rows. `load`: the 1-minute load average
    at the start and at the end."""
    by_name = {c.name: c for c in contestants if c.runs}
    dtypes = ", ".join(f"{c.name} {c.dtype}" for c in by_name.values())
    lines = [
        f"triode bench embed: {Path(args.model).name}; {dtypes}",
        f"CPU: {cpu}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end",
        f"sentences of 8-60 words, {workload_text(args)}; the servers get {args.concurrency} "
        f"requests in flight, {SENTENCE_TRANSFORMERS} one encode() call at a time",
        "",
    ]
    notes = [c for c in contestants if c.note]
    contestants = list(by_name.values())  # those without rows say why in a note
    ratios = [n for n in TARGETS if TRIODE in by_name and n in by_name]
    header = ["b", *(f"{_SHORT.get(c.name, c.name)} sent/s" for c in contestants)]
    header += [f"triode/{_SHORT.get(n, n)} (target >= {TARGETS[n]:.1f}x)" for n in ratios]
    header += [f"{_SHORT.get(c.name, c.name)} p50 ms" for c in contestants]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for b in args.batch_list:
        runs = [c.runs.get(b) for c in contestants]
        cells = [str(b), *(_rate(r) for r in runs)]
        triode = by_name[TRIODE].runs.get(b) if TRIODE in by_name else None
        cells += [_ratio(triode, by_name[n].runs.get(b), TARGETS[n]) for n in ratios]
        cells += [f"{r.p50_ms:,.1f}" if r is not None and r.sentences else "-" for r in runs]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    agreeing = [(c.name, c.agreement) for c in contestants if c.agreement is not None]
    if agreeing:
        lines.append(
            f"agreement with {SENTENCE_TRANSFORMERS} in float32, cosine over "
            f"{args.agreement_sentences} sentences: "
            + "; ".join(f"{name} min {low:.6f} mean {mean:.6f}" for name, (low, mean) in agreeing)
        )
    starts = [f"{c.name} {c.start_s:.1f} s" for c in contestants if c.start_s is not None]
    if starts:
        lines.append("start to healthy: " + ", ".join(starts))
    lines += [f"{c.name}: {c.note}" for c in notes]
    for c in contestants:
        for run in c.runs.values():
            if run.error:
                lines.append(f"{c.name} at b={run.batch}: {run.failed} failed, first: {run.error}")
    return "\n".join(lines)


def workload_text(args: argparse.Namespace) -> str:
    """How many requests each batch size is timed over, in words."""
    if args.requests is not None:
        return f"{args.requests} requests at each b"
    return f"{SENTENCES_AT_ONE} at b=1 and {SENTENCES_BATCHED} at larger b"
