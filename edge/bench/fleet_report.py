"""What `triode bench fleet` prints and writes: an instance's prefix-cache counters read from its
`/metrics`, a configuration's summary, and per instance count a table with the router's added
latency and `kv_aware` against `round_robin`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from .fleet_workload import ChatResult

DIRECT = "direct"  # no router: the client itself takes the instances in turn
# the goals: what the router adds to TTFT's median, and kv_aware's hit rate over round_robin's
TARGET_ADDED_MS = 1.0
TARGET_HIT_RATIO = 1.8
QUERIES = "triode:prefix_cache_queries_total"
HITS = "triode:prefix_cache_hits_total"


class CacheCounters(NamedTuple):
    """An instance's prompt tokens looked up in its prefix cache, and found there."""

    queries: float
    hits: float


def cache_counters(exposition: str) -> CacheCounters:
    """The prefix-cache counters of a `/metrics` answer, summed over their labels."""
    totals = {QUERIES: 0.0, HITS: 0.0}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return CacheCounters(totals[QUERIES], totals[HITS])


def summarize(
    config: str,
    results: Sequence[ChatResult],
    duration: float,
    before: Sequence[CacheCounters],
    after: Sequence[CacheCounters],
    expected: int,
) -> dict[str, Any]:
    """One configuration's run: the prefix-cache hit rate over all its instances (the counters'
    growth from `before` to `after`), TTFT and end-to-end percentiles in milliseconds and the
    output tokens per second of the successful requests, and the counts: `expected` requests,
    of which those after a failed turn of the same user were never sent (`skipped`)."""
    queries = [a.queries - b.queries for a, b in zip(after, before, strict=True)]
    hits = [a.hits - b.hits for a, b in zip(after, before, strict=True)]
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    errors = list(dict.fromkeys(r.error for r in results if not r.ok))
    return {
        "config": config,
        "instances": len(before),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "skipped": expected - len(results),
        "duration_s": duration,
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else math.nan,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "ttft_p50_ms": _percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": _percentile([r.ttft for r in ok], 99),
        "e2e_p50_ms": _percentile([r.latency for r in ok], 50),
        "output_tokens": output,
        "output_throughput": output / duration if duration > 0 else math.nan,
        "errors": errors[:5],
    }


def not_run(config: str, count: int, expected: int, error: str) -> dict[str, Any]:
    """`summarize`'s dict for a configuration that could not run: no figures, `error`."""
    nan = math.nan
    return {"config": config, "instances": count, "ok": 0, "failed": 0, "skipped": expected,
            "duration_s": nan, "hit_rate": nan, "prefix_cache_queries": [0.0] * count,
            "prefix_cache_hits": [0.0] * count, "ttft_p50_ms": nan, "ttft_p99_ms": nan,
            "e2e_p50_ms": nan, "output_tokens": 0, "output_throughput": nan,
            "errors": [error]}  # fmt: skip


def _percentile(seconds: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(seconds), q)) * 1e3 if seconds else math.nan


def _cell(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else f"{value:{spec}}"


def _spread(queries: Sequence[float]) -> str:
    """Each instance's share of the prompt tokens looked up, in percent."""
    total = sum(queries)
    return "/".join(f"{100 * q / total:.0f}" for q in queries) if total else "-"


HEAD = ("configuration", "hit rate %", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms",
        "output tok/s", "ok/failed", "prompt tokens by instance %")  # fmt: skip


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One instance count's configurations, a row each, then how they compare."""
    count = summaries[0]["instances"]
    lines = [f"{count} instances", "", "| " + " | ".join(HEAD) + " |"]
    lines.append("|" + "|".join(["---"] * len(HEAD)) + "|")
    for s in summaries:
        counts = f"{s['ok']}/{s['failed']}"
        counts += f" ({s['skipped']} not sent)" if s["skipped"] else ""
        figures = [_cell(100 * s["hit_rate"], ".1f")]
        figures += [_cell(s[k], ".1f") for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms")]
        figures.append(_cell(s["output_throughput"], ".1f"))
        row = [s["config"], *figures, counts, _spread(s["prefix_cache_queries"])]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", *comparisons({s["config"]: s for s in summaries})]
    lines += [f"{s['config']}: first error: {_one_line(s['errors'][0])}"
              for s in summaries if s["errors"]]  # fmt: skip
    return "\n".join(lines)


def comparisons(by_config: dict[str, dict[str, Any]]) -> list[str]:
    """The router's added latency (round_robin's TTFT median over the client's own round robin,
    under load and, where `probe` ran, idle) and kv_aware's hit rate and TTFT median against
    round_robin's, where both ran."""
    lines = []
    direct, rr, kv = (by_config.get(c) for c in (DIRECT, "round_robin", "kv_aware"))
    if direct and rr:
        added = rr["ttft_p50_ms"] - direct["ttft_p50_ms"]
        lines.append(
            f"router's added latency under load: {_cell(added, '+.2f')} ms TTFT p50 (round_robin "
            f"{_cell(rr['ttft_p50_ms'], '.2f')} ms - direct {_cell(direct['ttft_p50_ms'], '.2f')} "
            "ms; no verdict: on shared cores two runs' queueing differs by far more than the "
            f"{TARGET_ADDED_MS:g} ms target)"
        )
    if rr and (idle := rr.get("idle_ttft_p50_ms")):
        added = idle["router"] - idle["direct"]
        lines.append(
            f"router's added latency idle: {added:+.2f} ms TTFT p50 (one-token requests one at "
            f"a time: through round_robin {idle['router']:.2f} ms, direct {idle['direct']:.2f} "
            f"ms; target < {TARGET_ADDED_MS:g} ms: {_verdict(added < TARGET_ADDED_MS, added)})"
        )
    if rr and kv:
        ceiling = 1 / rr["hit_rate"] if rr["hit_rate"] else math.nan  # kv_aware finding all
        ratio = kv["hit_rate"] * ceiling
        lines.append(
            f"kv_aware hit rate: {_cell(ratio, '.2f')}x round_robin's "
            f"({_cell(100 * kv['hit_rate'], '.1f')}% vs {_cell(100 * rr['hit_rate'], '.1f')}%; "
            f"target >= {TARGET_HIT_RATIO:g}x: {_verdict(ratio >= TARGET_HIT_RATIO, ratio)}; "
            f"a 100% hit rate would be {_cell(ceiling, '.2f')}x)"
        )
        lower = kv["ttft_p50_ms"] < rr["ttft_p50_ms"]
        lines.append(
            f"kv_aware TTFT p50: {_cell(kv['ttft_p50_ms'], '.1f')} ms vs round_robin "
            f"{_cell(rr['ttft_p50_ms'], '.1f')} ms: {'lower' if lower else 'not lower'}"
        )
    return lines


def _verdict(met: bool, value: float) -> str:
    return "-" if math.isnan(value) else "met" if met else "NOT met"


def _one_line(error: str) -> str:
    """An error on one line: its first and last (a server's log tail lies between)."""
    lines = error.strip().splitlines()
    return f"{lines[0]} ... {lines[-1]}" if len(lines) > 1 else error
