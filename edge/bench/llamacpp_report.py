"""`triode bench llamacpp`'s tables: per file and stream count, triode beside llama-server (and
llama-cpp-python's server, when it ran), each figure the median over the rounds and each of
triode's ratios the median of the rounds' ratios."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .frontend import cpu_model
from .llamacpp_server import LLAMA_SERVER, LLAMACPP_PYTHON, TRIODE, slot_context

LABELS = {LLAMA_SERVER: "llama.cpp", LLAMACPP_PYTHON: "llama-cpp-python", TRIODE: "triode"}


def decode_speed(row: dict[str, Any]) -> float:
    """One request's tokens per second after its first: 1 / TPOT."""
    tpot = row["median_tpot_ms"]
    return 1000.0 / tpot if tpot > 0 else 0.0


def tokens_per_request(row: dict[str, Any]) -> float:
    return row["total_output_tokens"] / row["completed"] if row["completed"] else 0.0


FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "tok/s": lambda r: r["output_throughput"],
    "decode tok/s": decode_speed,
    "TTFT p50 ms": lambda r: r["median_ttft_ms"],
    "TTFT p99 ms": lambda r: r["p99_ttft_ms"],
    "peak RSS MiB": lambda r: r["peak_rss_mib"],
    "start s": lambda r: r["start_s"],
    "tokens": tokens_per_request,
    "others CPU %": lambda r: r["others_cpu_pct"],
}
RATIOS = ("tok/s", "decode tok/s")
# the table's figure columns: (figure, format, with triode's ratio to the baseline)
COLUMNS = (
    ("tok/s", ",.1f", True),
    ("decode tok/s", ",.1f", True),
    ("TTFT p50 ms", ",.0f", False),
    ("TTFT p99 ms", ",.0f", False),
    ("peak RSS MiB", ",.0f", False),
    ("start s", ".1f", False),
)


def summarize_rounds(
    rows: list[dict[str, Any]], file: str, concurrency: int, baseline: str
) -> dict[Any, Any] | None:
    """For one file and stream count, triode's and `baseline`'s figures as medians over the
    rounds each ran (None for one that never ran) and triode's ratios to `baseline` as the
    median of the ratios of the rounds both ran (None if none); None if neither ran."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["file"] == file and r["concurrency"] == concurrency and "error" not in r:
            rounds.setdefault(r["round"], {})[r["server"]] = r
    ran = {s: [pair[s] for pair in rounds.values() if s in pair] for s in (TRIODE, baseline)}
    if not ran[TRIODE] and not ran[baseline]:
        return None
    cell: dict[Any, Any] = {}
    for server, its in ran.items():
        for name, figure in FIGURES.items():
            cell[server, name] = statistics.median(figure(r) for r in its) if its else None
        cell[server, "failed"] = sum(r["failed"] for r in its) if its else None
    pairs = [pair for pair in rounds.values() if TRIODE in pair and baseline in pair]
    for name in RATIOS:
        figure = FIGURES[name]
        cell["ratio", name] = statistics.median(
            figure(p[TRIODE]) / figure(p[baseline]) if figure(p[baseline]) else 0.0 for p in pairs
        ) if pairs else None  # fmt: skip
    return cell


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def format_table(
    rows: list[dict[str, Any]], file: str, args: argparse.Namespace, baseline: str = LLAMA_SERVER
) -> str:
    """triode beside `baseline` on `file`: a row per stream count that either ran, `-` for the
    figures of one that did not."""
    other = LABELS[baseline]
    rounds = len({r["round"] for r in rows if r["file"] == file})
    head = ["streams"]
    for name, _, ratio in COLUMNS:
        head += [f"triode {name}", f"{other} {name}"] + (["ratio"] if ratio else [])
    head.append(f"failed (triode/{other})")
    lines = [
        f"{file}: triode vs {other}, medians of {rounds} round(s)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * len(head)) + "|",
    ]
    tokens: dict[str, list[str]] = {TRIODE: [], baseline: []}
    others: dict[str, list[str]] = {TRIODE: [], baseline: []}
    for c in args.concurrency_list:
        cell = summarize_rounds(rows, file, c, baseline)
        if cell is None:
            continue
        row = [str(c)]
        for name, spec, ratio in COLUMNS:
            row += [_cell(cell[TRIODE, name], spec), _cell(cell[baseline, name], spec)]
            row += [_cell(cell["ratio", name], ".2f", "x")] if ratio else []
        row.append(f"{_cell(cell[TRIODE, 'failed'], 'd')}/{_cell(cell[baseline, 'failed'], 'd')}")
        lines.append("| " + " | ".join(row) + " |")
        for server in tokens:
            tokens[server].append(_cell(cell[server, "tokens"], ".1f"))
            others[server].append(_cell(cell[server, "others CPU %"], ".0f", "%"))
    lines.append("")
    lines += [
        f"{LABELS[s]}: {', '.join(tokens[s])} tokens per request; other processes used "
        f"{', '.join(others[s])} of the machine's CPU time meanwhile"
        for s in (TRIODE, baseline)
        if set(tokens[s]) - {"-"}
    ]
    return "\n".join(lines)


def cpu_flags() -> str:
    """Which of AVX2, AVX-512 and AMX this machine's CPUs have, from /proc/cpuinfo."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    amx = sorted(f for f in flags if f.startswith("amx"))
    return ", ".join([
        "avx2" if "avx2" in flags else "no avx2",
        " ".join(avx512) if avx512 else "no avx512",
        " ".join(amx) if amx else "no amx",
    ])  # fmt: skip


def format_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The header, then a table per file (and per baseline), then what the servers ran."""
    lines = [
        f"triode vs llama.cpp: {args.output_len} output tokens per request (ignore_eos), "
        f"~{args.input_len}-word prompts, {args.prompts_per_stream} per stream",
        f"CPUs: {len(os.sched_getaffinity(0))} ({cpu_model()}; {cpu_flags()})",
        "",
    ]
    baselines = [s for s in (LLAMA_SERVER, LLAMACPP_PYTHON) if any(r["server"] == s for r in rows)]
    for model in args.models:
        for baseline in baselines:
            lines += [format_table(rows, model.name, args, baseline), ""]
    for r in rows:
        if "error" in r:
            last = r["error"].strip().splitlines()[-1]
            lines.append(
                f"{LABELS[r['server']]} failed on {r['file']} (round {r['round']}): {last}"
            )
    lines.append(
        f"llama.cpp: {args.llamacpp_threads} thread(s); llama-server restarted per stream count "
        f"with --parallel N, {slot_context(args.input_len, args.output_len)} tokens per slot, "
        "triode's --max-model-len the same"
    )
    if LLAMACPP_PYTHON in baselines:
        lines.append("llama-cpp-python runs one request at a time (N - 1 wait in its queue)")
    return "\n".join(lines)
