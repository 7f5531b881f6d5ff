"""`triode bench spec`: its workloads are built offline, the same each time, of the kinds they
claim; the counters become acceptance figures; the table puts the servers side by side with their
ratios and says whether the greedy texts agree; and a short run against real servers."""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from triode.edge.bench.spec import (
    ACCEPTED_TOKENS,
    DRAFT_TOKENS,
    DRAFTS,
    acceptance,
    cells,
    differences,
    first_difference,
    format_table,
    parse_args,
    read_counters,
    server_command,
    stream_chat,
)
from triode.edge.bench.spec_prompts import (
    CHAT_QUESTIONS,
    CODE_LINES,
    PROSE_TASKS,
    PROSE_WORDS,
    TASKS,
    chat_prompts,
    grounded_prompts,
    with_typos,
)


def test_grounded_prompts_are_the_same_for_a_seed_and_hold_their_passages() -> None:
    prompts = grounded_prompts(3 * len(TASKS), seed=0)

    assert prompts == grounded_prompts(3 * len(TASKS), seed=0)
    assert prompts != grounded_prompts(3 * len(TASKS), seed=1)
    assert [p.task for p in prompts] == list(TASKS) * 3
    for p in prompts:
        assert p.workload == "grounded" and p.passage and p.passage in p.text
        if p.task in PROSE_TASKS:
            assert PROSE_WORDS[0] <= len(p.passage.split()) <= PROSE_WORDS[1], p.passage
        else:
            assert CODE_LINES[0] <= len(p.passage.splitlines()) <= CODE_LINES[1], p.passage
            assert p.passage.startswith("def ") and "```python" in p.text
        if p.task == "rename":
            old, new = re.findall(r"`(\w+)`", p.text)[:2]
            assert re.search(rf"\b{old}\b", p.passage) and new == f"{old}_value"
    prose = [p.passage for p in prompts if p.task in PROSE_TASKS and p.task != "typos"]
    assert len(set(prose)) == len(prose)  # every passage once before any twice


def test_the_workloads_are_built_without_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a workload opened a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert len(grounded_prompts(20)) == 20 and len(chat_prompts(20)) == 20


def test_typos_swap_letters_inside_words_and_keep_the_words() -> None:
    text = grounded_prompts(1)[0].passage
    typed = with_typos(text, random.Random(0))
    pairs = list(zip(text.split(" "), typed.split(" "), strict=True))
    changed = [(a, b) for a, b in pairs if a != b]
    assert changed and all(sorted(a) == sorted(b) and a[0] == b[0] for a, b in changed)


def test_chat_prompts_are_plain_questions_each_asked_once_before_restyled() -> None:
    count = len(CHAT_QUESTIONS)
    prompts = chat_prompts(2 * count + 1)
    assert [p.text for p in prompts[:count]] == list(CHAT_QUESTIONS)
    assert len({p.text for p in prompts}) == len(prompts)
    assert prompts[count].text.startswith(CHAT_QUESTIONS[0]) and prompts[count].text != prompts[0]
    assert all(p.workload == "chat" and p.passage == "" for p in prompts)


def test_each_cell_has_prompts_of_its_own_and_twice_its_streams() -> None:
    args = parse_args(["--concurrency", "1,8", "--workloads", "chat,grounded"])
    plan = cells(args)
    assert [(w, c, len(p)) for w, c, p in plan] == [
        ("chat", 1, 4), ("chat", 8, 16), ("grounded", 1, 4), ("grounded", 8, 16),
    ]  # fmt: skip
    for workload in ("chat", "grounded"):
        texts = [p.text for w, _, prompts in plan if w == workload for p in prompts]
        assert len(set(texts)) == len(texts)
    fixed = parse_args(["--concurrency", "1,8", "--requests-per-cell", "3"])
    assert [len(p) for _, _, p in cells(fixed)] == [3, 3, 3, 3]


EXPOSITION = """\
# HELP triode:spec_decode_num_draft_tokens_total Draft tokens.
# TYPE triode:spec_decode_num_draft_tokens_total counter
triode:spec_decode_num_draft_tokens_total{model_name="m"} 120.0
triode:spec_decode_num_draft_tokens_created{model_name="m"} 1.7e+09
triode:spec_decode_num_accepted_tokens_total{model_name="m"} 48.0
triode:spec_decode_num_accepted_tokens_total{model_name="other"} 2.0
triode:spec_decode_num_drafts_total{model_name="m"} 30.0
triode:num_requests_running{model_name="m"} 3.0
"""


def test_the_counters_are_read_from_the_exposition_summed_over_labels() -> None:
    assert read_counters(EXPOSITION) == {DRAFT_TOKENS: 120.0, ACCEPTED_TOKENS: 50.0, DRAFTS: 30.0}
    assert read_counters("triode:num_requests_running 1.0\n") == {}


def test_acceptance_is_the_counters_growth_over_the_cell() -> None:
    before = {DRAFT_TOKENS: 10.0, ACCEPTED_TOKENS: 5.0, DRAFTS: 4.0}
    after = {DRAFT_TOKENS: 50.0, ACCEPTED_TOKENS: 35.0, DRAFTS: 14.0}
    got = acceptance(before, after)
    assert (got["draft_tokens"], got["accepted_tokens"], got["drafts"]) == (40.0, 30.0, 10.0)
    assert got["acceptance_rate"] == 0.75 and got["mean_acceptance_length"] == 4.0
    idle = acceptance(after, after)
    assert math.isnan(idle["acceptance_rate"]) and math.isnan(idle["mean_acceptance_length"])
    absent = acceptance({}, {})  # a server without speculation has no such counters
    assert math.isnan(absent["draft_tokens"]) and math.isnan(absent["acceptance_rate"])


def _row(server: str, workload: str, streams: int, tok_s: float, tpot: float, texts: list[str],
         **more: object) -> dict[str, object]:  # fmt: skip
    counted = {"acceptance_rate": math.nan, "mean_acceptance_length": math.nan}
    return {"server": server, "workload": workload, "concurrency": streams, "completed": len(texts),
            "failed": 0, "output_throughput": tok_s, "mean_tpot_ms": tpot, "texts": texts,
            "failed_indices": [], **counted, **more}  # fmt: skip


def _runs() -> list[dict[str, object]]:
    none = [_row("none", "grounded", 1, 20.0, 50.0, ["a b", "c d"]),
            _row("none", "chat", 1, 20.0, 50.0, ["x", "y z"])]  # fmt: skip
    spec = [_row("spec", "grounded", 1, 50.0, 20.0, ["a b", "c d"], acceptance_rate=0.75,
                 mean_acceptance_length=3.25),
            _row("spec", "chat", 1, 18.0, 55.0, ["x", "y q"], acceptance_rate=0.1,
                 mean_acceptance_length=1.2)]  # fmt: skip
    return [{"server": "none", "command": ["triode", "serve"], "rows": none},
            {"server": "spec", "command": ["triode", "serve", "--speculative-config", "{}"],
             "rows": spec}]  # fmt: skip


def test_the_table_puts_spec_beside_none_with_ratios_and_acceptance() -> None:
    argv = ["--concurrency", "1"]
    table = format_table(_runs(), parse_args(argv), argv)

    body = [line.strip("| ").split(" | ") for line in table.splitlines()
            if line.startswith("| ") and line[2] != "w"]  # fmt: skip
    assert body == [
        ["grounded", "1", "2", "20.0", "50.0", "2.50x", "50.0", "20.0", "0.40x", "0.750",
         "3.25", "0/0"],
        ["chat", "1", "2", "20.0", "18.0", "0.90x", "50.0", "55.0", "1.10x", "0.100", "1.20",
         "0/0"],
    ]  # fmt: skip
    assert "CPU: " in table and "bench: triode bench spec --concurrency 1" in table
    assert "spec: triode serve --speculative-config '{}'" in table
    assert "greedy outputs NOT identical: 1 of 4 differ: chat@1 #1 (from char 2)" in table


def test_greedy_texts_are_compared_request_by_request_skipping_failures() -> None:
    runs = _runs()
    assert differences(runs)["differ"] == [
        {"workload": "chat", "concurrency": 1, "index": 1, "at": 2}
    ]
    runs[1]["rows"][1]["failed_indices"] = [1]  # type: ignore[index]
    assert differences(runs) == {"compared": 3, "differ": []}
    assert differences(runs[:1]) == {}
    assert (first_difference("abc", "abd"), first_difference("ab", "abc")) == (2, 2)


def test_options_are_checked_and_only_the_spec_server_speculates() -> None:
    args = parse_args([])
    assert args.concurrency_list == [1, 8, 32] and args.workload_list == ["grounded", "chat"]
    assert json.loads(args.speculative_config)["method"] == "ngram"
    spec = server_command("spec", args, 8000)
    assert spec[spec.index("--speculative-config") + 1] == args.speculative_config
    assert "--speculative-config" not in server_command("none", args, 8000)
    control = parse_args(["--speculative-config", ""])
    assert "--speculative-config" not in server_command("spec", control, 8000)
    for bad in (["--concurrency", "0"], ["--workloads", "code"], ["--servers", "draft"],
                ["--max-tokens", "0"], ["--speculative-config", "[1]"],
                ["--speculative-config", "{"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


async def test_a_chat_stream_is_timed_and_its_text_kept() -> None:
    body = (
        _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
            {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
        )
        + b"data: [DONE]\n\n"
    )

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        return httpx.Response(200, content=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://t") as c:
        result, text = await stream_chat(c, {"stream": True})
    assert result.ok and (result.prompt_tokens, result.output_tokens) == (5, 2)
    assert text == "Hello world"


def _group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_a_short_run_measures_both_servers_and_leaves_none_running(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.bench.spec", "--concurrency", "1",
         "--requests-per-cell", "2", "--max-tokens", "8", "--workloads", "grounded",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    runs = {run["server"]: run for run in report["runs"]}
    assert list(runs) == ["none", "spec"]
    for run in runs.values():
        assert _group_gone(run["pid"]), f"{run['server']} server left running"
        [row] = run["rows"]
        assert (row["completed"], row["failed"]) == (2, 0) and row["total_output_tokens"] > 0
    assert runs["spec"]["rows"][0]["draft_tokens"] is not None  # its counters were read
    assert report["differences"] == {"compared": 2, "differ": []}  # greedy is exact
    assert "| grounded | 1 | 2 |" in done.stdout and "greedy outputs identical" in done.stdout
