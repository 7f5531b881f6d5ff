"""What `triode bench serve` prints and writes: the report table of one run, the serving
against offline comparison with its verdict on the overhead target, and the JSON-safe report."""

from __future__ import annotations

import math
from typing import Any

# the goal: serving costs at most this much of the offline engine's throughput at this many
# concurrent streams
TARGET_OVERHEAD_PCT = 10.0
TARGET_CONCURRENCY = 32


def format_report(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    lines = [f"{f' {title} ':=^52}"]
    rows: list[tuple[str, Any]] = [
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    for name, label in (
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token (excl. 1st)"),
        ("itl", "Inter-token latency"),
        ("e2el", "End-to-end latency"),
    ):
        rows.append((f"-- {label} --", None))
        rows += [(f"{stat.title()} {name.upper()} (ms)", summary[f"{stat}_{name}_ms"])
                 for stat in ("mean", "median", "p99")]  # fmt: skip
    if "edge_cpu_s" in summary:
        rows += [
            ("-- CPU (launched server) --", None),
            ("Edge process CPU (s)", summary["edge_cpu_s"]),
            ("Engine process CPU (s)", summary["engine_cpu_s"]),
            ("Output tokens per edge CPU-second", summary["output_tokens_per_edge_cpu_s"]),
        ]
    for label, value in rows:
        lines.append(f"{label:^52}" if value is None else f"{label:<38}{_cell(value):>14}")
    errors = summary["errors"]
    if errors:
        lines.append(f"first error: {errors[0]}")
    lines.append("=" * 52)
    return "\n".join(lines)


def format_comparison(serving: dict[str, Any], offline: dict[str, Any], concurrency: int) -> str:
    rows = [
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Request throughput (req/s)", "request_throughput"),
        *[(f"{s.title()} {n.upper()} (ms)", f"{s}_{n}_ms")
          for n in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")],
        ("Mean E2EL (ms)", "mean_e2el_ms"),
    ]  # fmt: skip
    lines = [f"{'':34}{'serving':>12}{'offline':>12}{'ratio':>9}"]
    for label, key in rows:
        a, b = serving[key], offline[key]
        ratio = a / b if b else math.nan
        lines.append(f"{label:34}{_cell(a):>12}{_cell(b):>12}{_cell(ratio, 'x'):>9}")
    ratio, overhead = overhead_of(serving, offline)
    verdict = "MET" if overhead <= TARGET_OVERHEAD_PCT else "NOT MET"
    lines.append(
        f"serving / offline output tok/s: {ratio:.3f}; serving overhead {overhead:.1f}% at "
        f"{concurrency} concurrent streams (target <= {TARGET_OVERHEAD_PCT:g}% at "
        f"{TARGET_CONCURRENCY}) {verdict}"
    )
    return "\n".join(lines)


def overhead_of(serving: dict[str, Any], offline: dict[str, Any]) -> tuple[float, float]:
    """(serving / offline output tokens/s, the percentage of throughput serving costs)."""
    offline_tok_s = offline["output_throughput"]
    ratio = serving["output_throughput"] / offline_tok_s if offline_tok_s else math.nan
    return ratio, (1.0 - ratio) * 100.0


def _cell(value: float, suffix: str = "") -> str:
    if isinstance(value, int):
        return str(value)
    return "-" if math.isnan(value) else f"{value:.2f}{suffix}"


def json_safe(value: Any) -> Any:
    """`value` with NaN and the infinities, which JSON lacks, as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
