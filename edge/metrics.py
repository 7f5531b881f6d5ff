"""Prometheus metrics under vLLM's names, each labelled with `model_name`, exposed twice: as
`triode:` and as `vllm:` (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_hits`, ...), so that routers and dashboards made for vLLM read them as they
are, and triode's own names stay stable.

Nothing per request is exposed: no ids, prompts or users, and every label takes its values from
a fixed set (the served name, the finish reasons, the prompt-token sources, the positions in a
speculative draft), so no client can add series.

Several API server processes (`--api-server-count`) share their metrics through
prometheus-client's multiprocess mode: the parent points `PROMETHEUS_MULTIPROC_DIR` at a
directory of its own before they start, each process's counters and histograms live in files
there, and whichever process answers `/metrics` adds them all up. The scheduler gauges are the
engine's, so the most recent one set wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from triode.wire import FinishReason

# Bucket boundaries as in vLLM's `vllm/v1/metrics/loggers.py`, so dashboards carry over.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_LABELS = ("model_name",)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    """The server's metrics, in a registry of their own unless one is given.

    A private registry keeps several apps in one process from clashing over metric names.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._model_name = model_name
        self._multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r, multiprocess_mode="mostrecent").labels(
                model_name
            )

        def counter(name: str, doc: str) -> Counter:
            # prometheus-client exposes a Counter as `<name>_total`.
            return Counter(name, doc, _LABELS, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=r, buckets=buckets).labels(model_name)

        self._running = gauge("triode:num_requests_running", "Requests in model execution.")
        self._waiting = gauge("triode:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("triode:kv_cache_usage_perc", "KV-cache usage; 1 means full.")
        self._prompt_tokens = counter("triode:prompt_tokens", "Prefill tokens processed.")
        self._generation_tokens = counter("triode:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "triode:request_success",
            "Finished requests, by finish reason.",
            (*_LABELS, "finished_reason"),
            registry=r,
        )
        # Created up front so every reason is exposed, at zero, before its first request; no
        # other label value is ever made (a series per distinct value would grow without bound).
        self._reasons = frozenset(str(reason) for reason in FinishReason)
        for reason in self._reasons:
            self._success.labels(model_name, reason)
        self._ttft = histogram(
            "triode:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self._itl = histogram(
            "triode:inter_token_latency_seconds", "Time between output tokens.", INTER_TOKEN_BUCKETS
        )
        self.engine = _EngineCollector(model_name)
        r.register(self.engine)
        self._e2e = histogram(
            "triode:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            REQUEST_LATENCY_BUCKETS,
        )

    def update_scheduler(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the scheduler gauges; `kv_cache_usage` is a fraction in [0, 1]."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_usage.set(kv_cache_usage)

    def observe_request(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        ttft: float | None,
        inter_token_latencies: Iterable[float],
        e2e: float,
        finished_reason: str,
    ) -> None:
        """Record one finished request. `ttft` is None when no token was produced; a reason
        that is not a `FinishReason`'s name (one cut short has none) counts as `abort`."""
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        reason = finished_reason if finished_reason in self._reasons else "abort"
        self._success.labels(self._model_name, reason).inc()
        if ttft is not None:
            self._ttft.observe(ttft)
        for latency in inter_token_latencies:
            self._itl.observe(latency)
        self._e2e.observe(e2e)

    def update_engine(self, stats: Mapping[str, Any]) -> None:
        """Take the engine core's counters (its `get_stats`), exposed from then on."""
        self.engine.stats = dict(stats)

    def render(self) -> tuple[bytes, bytes]:
        """The exposition text and its content type, for `GET /metrics`: this process's
        metrics, or with several API servers all of theirs."""
        registry = self.registry
        if self._multiproc_dir:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self._multiproc_dir)
            registry.register(self.engine)
        return with_vllm_names(generate_latest(registry)), CONTENT_TYPE_LATEST.encode()


def with_vllm_names(text: bytes) -> bytes:
    """The exposition `text` followed by each of its `triode:` families again as `vllm:`."""
    copies = [
        line.replace(b"triode:", b"vllm:", 1)
        for line in text.splitlines()
        if line.startswith((b"triode:", b"# HELP triode:", b"# TYPE triode:"))
    ]
    return text + b"\n".join(copies) + b"\n" if copies else text


# two counters, then two gauges: (name, the engine's stat, help)
_KV_TRANSFER_METRICS = (
    ("triode:kv_transfer_failures", "kv_load_failures", "KV loads that failed."),
    ("triode:kv_transfer_protocol_errors", "kv_protocol_errors", "Malformed KV messages."),
    ("triode:kv_transfer_loading_reqs", "num_loading_reqs", "Requests loading KV."),
    ("triode:kv_transfer_held_reqs", "num_held_reqs", "Finished requests holding KV."),
)


# the prefix cache's and the scheduler's counters, cumulative: (name, the engine's stat, help)
_CACHE_METRICS = (
    ("triode:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up."),
    ("triode:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the cache."),
    ("triode:num_preemptions", "num_preemptions", "Requests preempted."),
)


# speculative decoding's counters, only while it is on: (name, the engine's stat, help)
_SPEC_DECODE_METRICS = (
    (
        "triode:spec_decode_num_drafts",
        "spec_num_drafts",
        "Drafts verified: one per step per request with at least one proposal.",
    ),
    ("triode:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Proposed tokens verified."),
    (
        "triode:spec_decode_num_accepted_tokens",
        "spec_num_accepted_tokens",
        "Proposed tokens accepted.",
    ),
)


class _EngineCollector(Collector):
    """Counters the engine core keeps (cumulative there), exposed as of its last `get_stats`:
    where prompt tokens came from (vLLM's `prompt_tokens_by_source`), the KV connector's
    transfers, and speculative decoding's acceptance where it is on."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}
        # how often dead engine cores were started again, as the engine last knew it
        self.restarts = 0

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats, labels = self.stats, ["model_name"]
        by_source = CounterMetricFamily(
            "triode:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            labels=[*labels, "source"],
        )
        for source, key in (
            ("local_compute", "prompt_tokens_computed"),
            ("local_cache_hit", "prefix_cache_hits"),
            ("external_kv_transfer", "prompt_tokens_transferred"),
        ):
            by_source.add_metric([self.model_name, source], stats.get(key, 0))
        yield by_source
        families = (CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily)
        for family, (name, key, doc) in zip(families, _KV_TRANSFER_METRICS, strict=True):
            metric = family(name, doc, labels=labels)
            metric.add_metric([self.model_name], stats.get(key, 0))
            yield metric
        for name, key, doc in _CACHE_METRICS:
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric([self.model_name], stats.get(key, 0))
            yield metric
        refused = CounterMetricFamily(
            "triode:kv_transfer_params_refused",
            "kv_transfer_params refused: unsealed, altered, expired or for another prompt.",
            labels=labels,
        )
        refused.add_metric([self.model_name], stats.get("kv_params_refused", 0))
        yield refused
        restarts = CounterMetricFamily(
            "triode:engine_restarts",
            "Engine cores started again after they died (a crash, a kill, a dead rank).",
            labels=labels,
        )
        restarts.add_metric([self.model_name], self.restarts)
        yield restarts
        yield from self._spec_decode(stats)

    def _spec_decode(self, stats: dict[str, Any]) -> Iterator[CounterMetricFamily]:
        """vLLM's `spec_decode_*` counters; none without speculative decoding, whose stats
        carry none of their keys."""
        for name, key, doc in _SPEC_DECODE_METRICS:
            if key in stats:
                metric = CounterMetricFamily(name, doc, labels=["model_name"])
                metric.add_metric([self.model_name], stats[key])
                yield metric
        per_pos = stats.get("spec_num_accepted_tokens_per_pos")
        if per_pos is not None:
            metric = CounterMetricFamily(
                "triode:spec_decode_num_accepted_tokens_per_pos",
                "Proposed tokens accepted, by their position in the draft (0 first).",
                labels=["model_name", "position"],
            )
            for position, accepted in enumerate(per_pos):
                metric.add_metric([self.model_name, str(position)], accepted)
            yield metric
