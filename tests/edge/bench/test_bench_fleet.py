"""`triode bench fleet`: the chats' shape, the client's timing of a streamed chat, a user's
turns, the prefix-cache counters, the summaries and tables from made-up results, the options,
and the instances' command lines. No server and no router runs here."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from triode.edge.bench import fleet
from triode.edge.bench.fleet import (
    CONFIGS,
    Instance,
    header,
    instance_command,
    instance_cpus,
    parse_args,
)
from triode.edge.bench.fleet_report import (
    CacheCounters,
    cache_counters,
    format_table,
    not_run,
    summarize,
)
from triode.edge.bench.fleet_workload import (
    ChatResult,
    build_conversations,
    messages_for,
    probe,
    run_workload,
    stream_chat,
    system_prompt,
    warm_up,
)


def test_users_of_a_group_share_its_system_prompt_and_groups_differ_from_the_start() -> None:
    conversations = build_conversations(10, 3, 4, 200, seed=0)

    assert [c.group for c in conversations] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    systems = {c.group: c.system for c in conversations}
    assert all(c.system == systems[c.group] for c in conversations)
    # the group's number comes within the first KV block, so no two groups share one
    assert len({s[:12] for s in systems.values()}) == 3
    questions = [q for c in conversations for q in c.questions]
    assert all(len(c.questions) == 3 for c in conversations)
    assert len(set(questions)) == 30
    assert build_conversations(10, 3, 4, 200, seed=0) == conversations
    assert build_conversations(10, 3, 4, 200, seed=1) != conversations


@pytest.mark.parametrize("tokens", [100, 1000])
def test_a_system_prompt_holds_about_as_many_words_and_stops_as_tokens_asked(tokens: int) -> None:
    text = system_prompt(3, tokens, seed=0)
    # the words and full stops, each about a token
    estimate = len(text.split()) + text.count(".")
    assert tokens <= estimate <= tokens + 20
    assert len(set(text.split(". "))) > 5  # varied sentences, not one repeated


def test_turn_k_carries_the_system_prompt_the_earlier_questions_and_answers() -> None:
    conversation = build_conversations(1, 3, 1, 50, seed=0)[0]

    messages = messages_for(conversation, 2, ["first answer", "second answer"])

    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "user", "assistant", "user"
    ]  # fmt: skip
    assert [m["content"] for m in messages] == [
        conversation.system,
        conversation.questions[0], "first answer",
        conversation.questions[1], "second answer",
        conversation.questions[2],
    ]  # fmt: skip
    assert len(messages_for(conversation, 0, [])) == 2


def _sse(*events: dict[str, Any], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _delta(**delta: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


OPENING = _delta(role="assistant", content="")
USAGE = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}


async def _chat(response: httpx.Response) -> ChatResult:
    transport = httpx.MockTransport(lambda request: response)
    async with httpx.AsyncClient(transport=transport) as client:
        return await stream_chat(client, "http://test", {"messages": []})


async def test_a_chat_stream_yields_its_text_usage_and_a_ttft_within_its_latency() -> None:
    body = _sse(OPENING, _delta(content="Hello"), _delta(content=" there"), USAGE)

    result = await _chat(httpx.Response(200, content=body))

    assert result.ok and not result.error and result.status == 200
    assert result.text == "Hello there"
    assert (result.prompt_tokens, result.output_tokens) == (30, 2)
    assert 0 < result.ttft <= result.latency


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(503, content=b"no worker"), "HTTP 503: no worker"),
        (httpx.Response(200, content=_sse(OPENING, USAGE)), "no completion tokens"),
        (httpx.Response(200, content=_sse(_delta(content="a"))), "no completion tokens"),
        (httpx.Response(200, content=_sse(_delta(content="a"), USAGE, done=False)), "[DONE]"),
        (httpx.Response(200, content=_sse({"error": {"message": "boom"}})), "boom"),
    ],
)
async def test_a_chat_stream_that_fails_is_returned_with_its_error(
    response: httpx.Response, error: str
) -> None:
    result = await _chat(response)
    assert not result.ok and error in result.error


async def test_the_workload_takes_urls_in_turn_and_feeds_each_answer_to_the_next_turn() -> None:
    seen: list[tuple[str, list[dict[str, str]]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        seen.append((request.url.host, messages))
        turn = sum(m["role"] == "user" for m in messages) - 1
        return httpx.Response(200, content=_sse(OPENING, _delta(content=f"answer {turn}"), USAGE))

    conversations = build_conversations(2, 3, 2, 40, seed=0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        results, duration = await run_workload(
            client, ["http://a", "http://b"], conversations, model="m", max_tokens=2,
            concurrency=2,
        )  # fmt: skip

    assert len(results) == 6 and all(r.ok for r in results) and duration > 0
    assert sorted((r.user, r.turn) for r in results) == [(u, t) for u in (0, 1) for t in range(3)]
    assert [host for host, _ in seen].count("a") == 3
    last = [messages for _, messages in seen if len(messages) == 6]
    assert [m["content"] for m in last[0] if m["role"] == "assistant"] == ["answer 0", "answer 1"]


async def test_users_arrive_an_interval_apart() -> None:
    """With `--arrival-interval`, user i's first request waits i intervals (trio's clock)."""
    started: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        started.append(trio.current_time())
        return httpx.Response(200, content=_sse(OPENING, _delta(content="a"), USAGE))

    conversations = build_conversations(3, 1, 3, 40, seed=0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await run_workload(
            client, ["http://a"], conversations, model="m", max_tokens=1, concurrency=3,
            arrival_interval=0.2,
        )  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert len(started) == 3 and all(0.15 < gap < 0.5 for gap in gaps), gaps


async def test_a_failed_turn_ends_its_users_conversation() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if len(json.loads(request.content)["messages"]) > 2:
            return httpx.Response(500, content=b"broken")
        return httpx.Response(200, content=_sse(OPENING, _delta(content="x"), USAGE))

    conversations = build_conversations(1, 4, 1, 40, seed=0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        results, _ = await run_workload(
            client, ["http://a"], conversations, model="m", max_tokens=2, concurrency=1
        )

    assert [(r.turn, r.ok, r.status) for r in results] == [(0, True, 200), (1, False, 500)]


async def test_the_idle_probe_alternates_the_router_with_each_instance_in_turn() -> None:
    hosts: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(200, content=_sse(OPENING, _delta(content="x"), USAGE))

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        router, direct = await probe(client, "http://r", ["http://a", "http://b"], "m", pairs=4)

    assert hosts == ["a", "r", "r", "b", "a", "r", "r", "b"]
    assert router > 0 and direct > 0


async def test_a_failed_warm_up_request_stops_the_run() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(404, content=b"no model"))
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 404"):
            await warm_up(client, ["http://a"], "m", 1)


EXPOSITION = """\
# HELP triode:prefix_cache_queries_total Prompt tokens looked up.
# TYPE triode:prefix_cache_queries_total counter
triode:prefix_cache_queries_total{model_name="m"} 1000.0
# HELP triode:prefix_cache_hits_total Prompt tokens found in the cache.
# TYPE triode:prefix_cache_hits_total counter
triode:prefix_cache_hits_total{model_name="m"} 640.0
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
"""


def test_the_cache_counters_are_triodes_own_not_their_vllm_copies() -> None:
    assert cache_counters(EXPOSITION) == CacheCounters(1000.0, 640.0)
    assert cache_counters("") == CacheCounters(0.0, 0.0)


def _ok(ttft: float, tokens: int = 16) -> ChatResult:
    return ChatResult(ok=True, ttft=ttft, latency=ttft + 0.1, output_tokens=tokens, status=200)


def _summary(config: str, ttfts: list[float], hits: tuple[float, float]) -> dict[str, Any]:
    before = [CacheCounters(100.0, 0.0), CacheCounters(50.0, 10.0)]
    after = [CacheCounters(1100.0, hits[0]), CacheCounters(1050.0, 10.0 + hits[1])]
    results = [_ok(t) for t in ttfts]
    return summarize(config, results, 2.0, before, after, expected=len(ttfts))


def test_a_summary_takes_the_counters_growth_and_the_successful_requests_only() -> None:
    failed = ChatResult(status=503, error="HTTP 503: busy")
    before = [CacheCounters(100.0, 0.0), CacheCounters(50.0, 10.0)]
    after = [CacheCounters(1100.0, 600.0), CacheCounters(3050.0, 1010.0)]
    results = [_ok(0.010), _ok(0.030), _ok(0.020), failed]

    summary = summarize("kv_aware", results, 4.0, before, after, expected=6)

    assert summary["hit_rate"] == pytest.approx(1600 / 4000)
    assert summary["prefix_cache_queries"] == [1000.0, 3000.0]
    assert summary["ttft_p50_ms"] == pytest.approx(20.0)
    assert summary["ttft_p99_ms"] == pytest.approx(29.8)
    assert summary["output_throughput"] == pytest.approx(48 / 4.0)
    assert (summary["ok"], summary["failed"], summary["skipped"]) == (3, 1, 2)
    assert summary["errors"] == ["HTTP 503: busy"]
    nothing = summarize("direct", [], 1.0, before, before, expected=0)
    assert math.isnan(nothing["hit_rate"]) and math.isnan(nothing["ttft_p50_ms"])


def _rows(table: str) -> dict[str, list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    return {row[0]: row[1:] for row in cells}


def test_the_table_has_a_row_per_configuration_and_compares_with_round_robin() -> None:
    summaries = [
        _summary("direct", [0.100, 0.200], (300.0, 0.0)),
        {
            **_summary("round_robin", [0.1005, 0.2005], (300.0, 0.0)),
            "idle_ttft_p50_ms": {"router": 20.25, "direct": 20.0},
        },
        _summary("kv_aware", [0.050, 0.150], (600.0, 0.0)),
    ]

    table = format_table(summaries)

    rows = _rows(table)
    assert list(rows) == ["direct", "round_robin", "kv_aware"]
    assert rows["kv_aware"][:2] == ["30.0", "100.0"]  # hit rate %, TTFT p50 ms
    assert rows["direct"][-2:] == ["2/0", "50/50"]
    assert "router's added latency under load: +0.50 ms" in table
    assert "added latency idle: +0.25 ms" in table and "target < 1 ms: met" in table
    assert "kv_aware hit rate: 2.00x round_robin's" in table and ">= 1.8x: met" in table
    assert "a 100% hit rate would be 6.67x" in table
    assert "kv_aware TTFT p50: 100.0 ms vs round_robin 150.5 ms: lower" in table


def test_a_configuration_that_did_not_run_shows_no_figures_and_its_error() -> None:
    summaries = [
        _summary("round_robin", [0.1], (10.0, 0.0)),
        not_run("kv_aware", 2, 4, "RuntimeError: the server exited\nlog line\npanic: no sources"),
    ]

    table = format_table(summaries)

    assert _rows(table)["kv_aware"] == ["-", "-", "-", "-", "-", "0/0 (4 not sent)", "-"]
    assert "kv_aware: first error: RuntimeError: the server exited ... panic: no sources" in table
    assert "kv_aware hit rate: -x" in table


def test_the_options_default_to_two_and_four_instances_under_every_configuration() -> None:
    args = parse_args([])
    assert args.instance_counts == [2, 4] and args.policies == list(CONFIGS)
    assert (args.users, args.turns, args.group_size) == (32, 4, 8)
    assert (args.system_tokens, args.max_tokens, args.concurrency) == (1000, 16, None)

    args = parse_args(["--instances", "3", "--policies", "direct,kv_aware", "--users", "4"])
    assert args.instance_counts == [3] and args.policies == ["direct", "kv_aware"]


@pytest.mark.parametrize(
    "argv",
    [["--instances", "two"], ["--instances", "0"], ["--policies", "nearest"], ["--turns", "0"],
     ["--concurrency", "0"], ["--arrival-interval", "-1"]],
)  # fmt: skip
def test_the_options_refuse_what_cannot_run(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_instances_share_the_cpus_equally_or_one_each_in_turn() -> None:
    assert instance_cpus(0, 1, [0, 1]) == [0, 1]
    assert [instance_cpus(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [instance_cpus(i, 4, [0, 1]) for i in range(4)] == [[0], [1], [0], [1]]
    assert [instance_cpus(i, 2, [4, 5, 6, 7]) for i in range(2)] == [[4, 5], [6, 7]]


def test_an_instance_publishes_its_kv_events_and_serves_the_admin_api() -> None:
    instance = Instance(port=8001, events_port=9001, replay_port=9002)

    command, env = instance_command(instance, [1])

    assert "--enable-admin-api" in command
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events["endpoint"] == instance.events == "tcp://127.0.0.1:9001"
    assert events["replay_endpoint"] == instance.replay
    assert command[command.index("--max-model-len") + 1] == "4096"
    assert env["OMP_NUM_THREADS"] == "1"
    if shutil.which("taskset"):
        assert command[1:3] == ["-c", "1"]
    assert "--kv-cache-memory" not in command
    small, _ = instance_command(instance, [1], "192MiB")
    assert small[small.index("--kv-cache-memory") + 1] == "192MiB"


def test_the_header_names_the_machine_the_command_and_the_workload() -> None:
    argv = ["--instances", "2", "--users", "8", "--group-size", "4"]

    text = header(parse_args(argv), argv)

    assert "cores" in text and "command: triode bench fleet --instances 2 --users 8" in text
    assert "8 users in 2 group(s) of 4" in text and "not a fleet's of real machines" in text


def test_a_run_prints_a_table_per_instance_count_and_the_failed_counts_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def run_count(count: int, args: Any, conversations: Any) -> tuple[int, list[Any]]:
        if count == 4:
            raise RuntimeError("the server exited with status 1 before it was ready")
        return 600, [_summary(c, [0.1, 0.2], (300.0, 0.0)) for c in args.policies]

    monkeypatch.setattr(fleet, "run_count", run_count)
    out = tmp_path / "fleet.json"

    fleet.main(["--instances", "2,4", "--policies", "direct,round_robin", "--json", str(out)])

    printed = capsys.readouterr().out
    assert list(_rows(printed)) == ["direct", "round_robin"]
    assert "4 instances did not run:\nRuntimeError: the server exited" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["instances"] for r in runs] == [2, 4] and "error" in runs[1]
    assert runs[0]["system_prompt_tokens"] == 600
