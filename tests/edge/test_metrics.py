"""Prometheus exposition: names, labels, values and bucket boundaries as scraped."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from triode.edge.metrics import (
    INTER_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Metrics,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(metrics: Metrics) -> tuple[dict[str, str], Samples]:
    body, content_type = metrics.render()
    assert content_type.startswith(b"text/plain")
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def test_exposed_names_and_types() -> None:
    types, samples = _scrape(Metrics("m"))
    assert types["triode:num_requests_running"] == "gauge"
    assert types["triode:num_requests_waiting"] == "gauge"
    assert types["triode:kv_cache_usage_perc"] == "gauge"
    assert types["triode:prompt_tokens"] == "counter"
    assert types["triode:generation_tokens"] == "counter"
    assert types["triode:request_success"] == "counter"
    assert types["triode:time_to_first_token_seconds"] == "histogram"
    assert types["triode:inter_token_latency_seconds"] == "histogram"
    assert types["triode:e2e_request_latency_seconds"] == "histogram"
    names = {name for name, _ in samples}
    assert {"triode:prompt_tokens_total", "triode:generation_tokens_total"} <= names
    assert "triode:request_success_total" in names
    assert "triode:prompt_tokens_total_total" not in names


def test_every_sample_carries_the_model_name() -> None:
    metrics = Metrics("qwen3-0.6b")
    metrics.observe_request(3, 2, 0.1, [0.02], 0.5, "stop")
    _, samples = _scrape(metrics)
    for name, labels in samples:
        assert ("model_name", "qwen3-0.6b") in labels, name


def test_scheduler_gauges_take_the_latest_values() -> None:
    metrics = Metrics("m")
    metrics.update_scheduler(4, 9, 0.25)
    metrics.update_scheduler(3, 7, 0.5)
    _, samples = _scrape(metrics)
    assert samples[("triode:num_requests_running", _labels(model_name="m"))] == 3
    assert samples[("triode:num_requests_waiting", _labels(model_name="m"))] == 7
    assert samples[("triode:kv_cache_usage_perc", _labels(model_name="m"))] == 0.5


def test_requests_add_up_tokens_and_count_by_finish_reason() -> None:
    metrics = Metrics("m")
    metrics.observe_request(10, 4, 0.05, [0.01, 0.02, 0.03], 0.2, "stop")
    metrics.observe_request(7, 16, 0.5, [], 3.0, "length")
    metrics.observe_request(5, 0, None, [], 0.1, "abort")
    _, samples = _scrape(metrics)
    m = _labels(model_name="m")
    assert samples[("triode:prompt_tokens_total", m)] == 22
    assert samples[("triode:generation_tokens_total", m)] == 20
    for reason, count in [("stop", 1), ("length", 1), ("abort", 1), ("error", 0)]:
        key = ("triode:request_success_total", _labels(model_name="m", finished_reason=reason))
        assert samples[key] == count
    assert samples[("triode:time_to_first_token_seconds_count", m)] == 2
    assert samples[("triode:time_to_first_token_seconds_sum", m)] == pytest.approx(0.55)
    assert samples[("triode:inter_token_latency_seconds_count", m)] == 3
    assert samples[("triode:e2e_request_latency_seconds_count", m)] == 3
    assert samples[("triode:e2e_request_latency_seconds_sum", m)] == pytest.approx(3.3)


def test_a_reason_outside_the_fixed_set_adds_no_series() -> None:
    metrics = Metrics("m")
    series = len(_scrape(metrics)[1])
    for reason in ("req-123", "tool_calls", "None", "x" * 1000):
        metrics.observe_request(1, 1, None, [], 0.1, reason)

    _, samples = _scrape(metrics)

    assert len(samples) == series
    key = ("triode:request_success_total", _labels(model_name="m", finished_reason="abort"))
    assert samples[key] == 4


def test_histograms_use_vllm_buckets() -> None:
    metrics = Metrics("m")
    metrics.observe_request(1, 2, 0.03, [0.06], 0.9, "stop")
    _, samples = _scrape(metrics)

    def bounds(name: str) -> list[float]:
        found = [
            float(dict(labels)["le"]) for sample, labels in samples if sample == f"{name}_bucket"
        ]
        return sorted(b for b in found if b != float("inf"))

    assert bounds("triode:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert bounds("triode:inter_token_latency_seconds") == list(INTER_TOKEN_BUCKETS)
    assert bounds("triode:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    assert INTER_TOKEN_BUCKETS[0] == 0.01 and INTER_TOKEN_BUCKETS[-1] == 80.0
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    m = _labels
    ttft = "triode:time_to_first_token_seconds_bucket"
    assert samples[(ttft, m(model_name="m", le="0.02"))] == 0
    assert samples[(ttft, m(model_name="m", le="0.04"))] == 1
    e2e = "triode:e2e_request_latency_seconds_bucket"
    assert samples[(e2e, m(model_name="m", le="0.8"))] == 0
    assert samples[(e2e, m(model_name="m", le="1.0"))] == 1


def test_two_instances_in_one_process_do_not_clash() -> None:
    first, second = Metrics("a"), Metrics("b")
    first.update_scheduler(1, 0, 0.0)
    second.update_scheduler(2, 0, 0.0)
    _, a = _scrape(first)
    _, b = _scrape(second)
    assert a[("triode:num_requests_running", _labels(model_name="a"))] == 1
    assert b[("triode:num_requests_running", _labels(model_name="b"))] == 2
    assert ("triode:num_requests_running", _labels(model_name="b")) not in a
    assert REGISTRY.get_sample_value("triode:num_requests_running", {"model_name": "a"}) is None


def test_a_given_registry_is_used() -> None:
    registry = CollectorRegistry()
    metrics = Metrics("m", registry=registry)
    assert metrics.registry is registry
    assert registry.get_sample_value("triode:num_requests_running", {"model_name": "m"}) == 0


SPEC_FAMILIES = {
    "triode:spec_decode_num_drafts",
    "triode:spec_decode_num_draft_tokens",
    "triode:spec_decode_num_accepted_tokens",
    "triode:spec_decode_num_accepted_tokens_per_pos",
}


def test_speculative_decoding_counters_take_the_engines_latest_stats() -> None:
    metrics = Metrics("m")
    metrics.update_engine({"spec_num_drafts": 1, "spec_num_accepted_tokens_per_pos": [1, 0, 0]})
    metrics.update_engine(
        {
            "prompt_tokens_computed": 12,
            "spec_num_drafts": 40,
            "spec_num_draft_tokens": 120,
            "spec_num_accepted_tokens": 71,
            "spec_num_accepted_tokens_per_pos": [35, 22, 14],
        }
    )

    types, samples = _scrape(metrics)

    assert {name: types[name] for name in SPEC_FAMILIES} == dict.fromkeys(SPEC_FAMILIES, "counter")
    m = _labels(model_name="m")
    assert samples[("triode:spec_decode_num_drafts_total", m)] == 40
    assert samples[("triode:spec_decode_num_draft_tokens_total", m)] == 120
    assert samples[("triode:spec_decode_num_accepted_tokens_total", m)] == 71
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name == "triode:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 35, "1": 22, "2": 14}
    computed = _labels(model_name="m", source="local_compute")
    assert samples[("triode:prompt_tokens_by_source_total", computed)] == 12


def test_without_speculative_decoding_no_spec_family_is_exposed() -> None:
    metrics = Metrics("m")
    metrics.update_engine({"prompt_tokens_computed": 12, "kv_load_failures": 1})

    types, samples = _scrape(metrics)

    assert "triode:prompt_tokens_by_source" in types
    assert not SPEC_FAMILIES & set(types)
    assert not [name for name, _ in samples if name.startswith("triode:spec_decode")]


def test_every_family_is_exposed_under_vllms_prefix_too_with_the_same_samples() -> None:
    """Routers and dashboards made for vLLM read `vllm:` names (vllm-router's load signals:
    `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`)."""
    metrics = Metrics("m")
    metrics.update_scheduler(3, 2, 0.25)
    metrics.observe_request(3, 2, 0.1, [0.02], 0.5, "stop")
    metrics.update_engine({"prefix_cache_queries": 64, "prefix_cache_hits": 48})
    types, samples = _scrape(metrics)
    triode = {n.removeprefix("triode:"): t for n, t in types.items() if n.startswith("triode:")}
    vllm = {n.removeprefix("vllm:"): t for n, t in types.items() if n.startswith("vllm:")}
    assert triode == vllm and len(vllm) > 10
    assert len(types) == 2 * len(vllm)
    ours = {(n.removeprefix("triode:"), labels): v for (n, labels), v in samples.items()
            if n.startswith("triode:")}  # fmt: skip
    theirs = {(n.removeprefix("vllm:"), labels): v for (n, labels), v in samples.items()
              if n.startswith("vllm:")}  # fmt: skip
    assert ours == theirs
    model = _labels(model_name="m")
    assert samples[("vllm:num_requests_running", model)] == 3
    assert samples[("vllm:num_requests_waiting", model)] == 2
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", model)] == 64
    assert samples[("vllm:prefix_cache_hits_total", model)] == 48
