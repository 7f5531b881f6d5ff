"""`triode bench serve`: the workload, the client's timing of streams, the summary math, the
options, and starting and stopping a server process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from processes import alive

from triode.edge.bench.completion_stream import RequestResult, stream_completion
from triode.edge.bench.serve import main, parse_args, run_benchmark, summarize, synthetic_prompts
from triode.edge.bench.serve_report import format_comparison, overhead_of
from triode.edge.bench.server_process import open_server, serve_command
from triode.wire.ports import free_port


def test_synthetic_prompts_are_the_same_for_the_same_seed() -> None:
    prompts = synthetic_prompts(8, 32, seed=1)
    assert prompts == synthetic_prompts(8, 32, seed=1)
    assert prompts != synthetic_prompts(8, 32, seed=2)
    assert len(set(prompts)) == 8
    assert all(len(p.split()) == 32 for p in prompts)


def test_synthetic_prompts_are_input_len_tokens_for_the_default_tokenizer() -> None:
    from tokenizers import Tokenizer

    from triode.gpu.cache_paths import converted_dir, default_gguf

    if not default_gguf().is_file() or not converted_dir(default_gguf()).is_dir():
        pytest.skip("the default model is not fetched and converted; run `make model`")
    tokenizer = Tokenizer.from_file(str(converted_dir(default_gguf()) / "tokenizer.json"))
    for input_len in (16, 128, 1000):
        lengths = [len(tokenizer.encode(p).ids) for p in synthetic_prompts(10, input_len, 0)]
        assert all(abs(n - input_len) <= input_len * 0.05 for n in lengths), lengths


def test_summary_of_known_requests() -> None:
    results = [
        RequestResult(True, 0.1, 1.1, [0.1] * 10, prompt_tokens=5, output_tokens=11),
        RequestResult(True, 0.3, 2.3, [0.5] * 4, prompt_tokens=7, output_tokens=5),
        RequestResult(error="HTTP 500: boom"),
    ]
    s = summarize(results, duration=4.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (12, 16)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(7.0)
    # percentiles interpolate linearly between the sorted values, as numpy's default does
    expected = {
        "ttft": (200.0, 200.0, 298.0),
        "tpot": (300.0, 300.0, 496.0),  # (e2e - ttft) / (tokens - 1): 100 ms and 500 ms
        "itl": (3000 / 14, 100.0, 500.0),
        "e2el": (1700.0, 1700.0, 2288.0),
    }
    for name, (mean, median, p99) in expected.items():
        got = (s[f"mean_{name}_ms"], s[f"median_{name}_ms"], s[f"p99_{name}_ms"])
        assert got == pytest.approx((mean, median, p99)), name


def test_summary_with_no_successes_has_no_latencies() -> None:
    s = summarize([RequestResult(error="x")], duration=1.0)
    assert (s["completed"], s["output_throughput"]) == (0, 0.0)
    assert math.isnan(s["mean_ttft_ms"]) and math.isnan(s["p99_itl_ms"])


def test_one_token_requests_have_no_tpot() -> None:
    s = summarize([RequestResult(True, 0.1, 0.1, [], output_tokens=1)], duration=1.0)
    assert s["mean_ttft_ms"] == pytest.approx(100.0)
    assert math.isnan(s["mean_tpot_ms"])


def test_comparison_reports_the_ratio_and_whether_the_overhead_target_is_met() -> None:
    offline = summarize([RequestResult(True, 0.1, 1.0, [0.1], output_tokens=100)], 1.0)
    serving = summarize([RequestResult(True, 0.1, 1.0, [0.1], output_tokens=92)], 1.0)
    assert overhead_of(serving, offline) == pytest.approx((0.92, 8.0))
    table = format_comparison(serving, offline, concurrency=32)
    assert "0.920" in table and "8.0%" in table and table.endswith(" MET")
    slow = summarize([RequestResult(True, 0.1, 1.0, [0.1], output_tokens=85)], 1.0)
    assert format_comparison(slow, offline, concurrency=32).endswith("NOT MET")


def test_options_default_to_a_running_server_on_port_8000(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRIODE_API_KEY", "from-env")
    args = parse_args([])
    assert args.base_url == "http://127.0.0.1:8000" and not args.launch
    assert (args.model, args.api_key, args.max_concurrency) == (None, "from-env", 32)
    assert args.request_rate == math.inf and not args.compare_offline


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["--tiny"], "tiny-random"),
        (["--launch"], None),
        (["--launch", "/models/x"], "/models/x"),
        (["--compare-offline"], None),
        (["--compare-offline", "--tiny"], "tiny-random"),
    ],
)
def test_options_that_launch_a_server(argv: list[str], model: str | None) -> None:
    args = parse_args(argv)
    assert args.launch and args.launch_model == model


@pytest.mark.parametrize(
    "argv",
    [
        ["--tiny", "--launch", "m"],
        ["--compare-offline", "--base-url", "http://h:1"],
        ["--max-concurrency", "0"],
        ["--request-rate", "0"],
    ],
)
def test_contradictory_or_empty_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_serve_command_names_the_model_host_port_and_engine_flags() -> None:
    assert serve_command(None, 1234)[1:] == [
        "-m", "triode.edge.cli", "serve", "--host", "127.0.0.1", "--port", "1234",
    ]  # fmt: skip
    command = serve_command("tiny-random", 5, dtype="float32", max_num_seqs=8)
    assert command[4:] == [
        "tiny-random", "--host", "127.0.0.1", "--port", "5", "--dtype", "float32",
        "--max-num-seqs", "8",
    ]  # fmt: skip


def _sse(*events: dict[str, Any], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _text(t: str, usage: dict[str, int] | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t}], "usage": usage}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


async def _stream(response: httpx.Response) -> RequestResult:
    transport = httpx.MockTransport(lambda request: response)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await stream_completion(client, {"prompt": "p"})


async def test_a_stream_yields_ttft_one_itl_per_later_chunk_and_usage_tokens() -> None:
    # a token whose text is empty (a random model's, say) still arrives as a chunk and counts
    final = {"choices": [], "usage": _usage(7, 4)}
    body = _sse(_text(" a"), _text(""), _text(" b"), _text(" c"), final)
    result = await _stream(httpx.Response(200, content=body))
    assert result.ok and not result.error
    assert (result.prompt_tokens, result.output_tokens, len(result.itl)) == (7, 4, 3)
    assert 0 < result.ttft <= result.latency


async def test_chunks_with_usage_spread_their_gap_over_their_tokens() -> None:
    body = _sse(_text(" a", _usage(4, 1)), _text(" b c d", _usage(4, 4)), _text(" e", _usage(4, 5)))
    result = await _stream(httpx.Response(200, content=body))
    assert result.ok and result.output_tokens == 5
    assert len(result.itl) == 4 and result.itl[0] == result.itl[1] == result.itl[2]


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(400, content=b'{"error": "too long"}'), 'HTTP 400: {"error": "too long"}'),
        (httpx.Response(200, content=_sse(_text(" a"), done=False)), "without [DONE]"),
        (httpx.Response(200, content=_sse(_text(" a"))), "no completion tokens"),
        (httpx.Response(200, content=_sse({"error": {"message": "boom"}})), "boom"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "DecodeError"),
    ],
)
async def test_a_failed_stream_is_an_error_not_an_exception(
    response: httpx.Response, error: str
) -> None:
    result = await _stream(response)
    assert not result.ok and error in result.error


class FakeCompletions:
    """An OpenAI-style server that streams `max_tokens` one-token chunks and counts streams."""

    def __init__(self) -> None:
        self.active = self.peak = 0
        self.requests: list[dict[str, Any]] = []
        self.authorization: set[bytes] = set()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        self.authorization.add(dict(scope["headers"]).get(b"authorization", b""))
        if scope["path"] == "/v1/models":
            await self._respond(send, 200, b'{"object": "list", "data": [{"id": "fake"}]}')
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.requests.append(request)
        if request["prompt"] == "FAIL":
            await self._respond(send, 500, b'{"error": {"message": "failed on purpose"}}')
            return
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            n = request["max_tokens"]
            for i in range(n):
                chunk = _sse(_text(f" t{i}"), done=False)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await trio.lowlevel.checkpoint()
            tail = _sse({"choices": [], "usage": _usage(len(request["prompt"].split()), n)})
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            self.active -= 1

    @staticmethod
    async def _respond(send: Callable, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


@pytest.fixture
async def fake_server(nursery: trio.Nursery) -> AsyncIterator[tuple[str, FakeCompletions]]:
    app = FakeCompletions()
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    stop = trio.Event()
    binds = await nursery.start(partial(serve, app, config, shutdown_trigger=stop.wait))
    yield binds[0], app
    stop.set()


async def test_benchmark_against_a_fake_server_counts_tokens_failures_and_limits_streams(
    fake_server: tuple[str, FakeCompletions],
) -> None:
    url, app = fake_server
    prompts = [*synthetic_prompts(11, 20, seed=0), "FAIL"]
    report = await run_benchmark(
        url, model=None, prompts=prompts, output_len=6, max_concurrency=3, api_key="k"
    )
    assert report["model"] == "fake" and app.authorization == {b"Bearer k"}
    assert (report["completed"], report["failed"]) == (11, 1)
    assert "failed on purpose" in report["errors"][0]
    assert report["total_output_tokens"] == 11 * 6
    assert report["total_input_tokens"] == 11 * 20
    assert 1 <= app.peak <= 3
    assert len(app.requests) == 1 + 12  # a warm-up first
    sent = app.requests[1]
    assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
    assert [sent[k] for k in ("model", "max_tokens", "temperature", "ignore_eos")] == [
        "fake",
        6,
        0,
        True,
    ]
    ok = [r for r in report["requests"] if r["ok"]]
    assert all(len(r["itl"]) == 5 and r["ttft"] <= r["latency"] for r in ok)


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


HEALTH_SERVER = """
import http.server, signal, sys
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
try:
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
except KeyboardInterrupt:
    pass
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["polite", "stubborn"])
async def test_open_server_waits_for_health_and_stops_the_server(kind: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as client:
        async with open_server(_python(HEALTH_SERVER, str(port), kind), url, stop_timeout=1.0):
            assert (await client.get("/health")).status_code == 200
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


ORPHANING_SERVER = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"])
open(sys.argv[2], "w").write(str(child.pid))
""" + HEALTH_SERVER.replace("sys.argv[2] ==", "'polite' ==")


@pytest.mark.slow
async def test_leaving_open_server_ends_the_children_the_server_left(tmp_path: Path) -> None:
    port, pid_file = free_port(), tmp_path / "child.pid"
    url = f"http://127.0.0.1:{port}"
    command = _python(ORPHANING_SERVER, str(port), str(pid_file))
    async with open_server(command, url, stop_timeout=1.0):
        child = int(pid_file.read_text())
        assert alive(child)
    with trio.fail_after(5):
        while alive(child):  # noqa: ASYNC110 - another process (reaped by init)
            await trio.sleep(0.05)


@pytest.mark.slow
async def test_a_server_that_exits_early_is_reported_with_its_output() -> None:
    command = _python("print('no such model'); raise SystemExit(3)")
    with pytest.raises(RuntimeError, match=r"(?s)status 3.*no such model"):
        async with open_server(command, f"http://127.0.0.1:{free_port()}"):
            pass


@pytest.mark.slow
async def test_a_server_that_never_gets_ready_times_out() -> None:
    command = _python("import time; time.sleep(60)")
    with pytest.raises(TimeoutError, match=r"not ready after 0\.5 s"):
        url = f"http://127.0.0.1:{free_port()}"
        async with open_server(command, url, ready_timeout=0.5, stop_timeout=1.0):
            pass


@pytest.mark.slow
def test_triode_bench_serve_is_a_cli_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "bench", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--compare-offline" in done.stdout and "--max-concurrency" in done.stdout
    assert "Warning" not in done.stderr  # runpy runs the module without complaint


@pytest.mark.slow
def test_compare_offline_measures_a_launched_tiny_server_then_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRIODE_CACHE", str(tmp_path / "cache"))
    report_path = tmp_path / "report.json"
    argv = ["--tiny", "--compare-offline", "--num-prompts", "8", "--input-len", "16"]
    main([*argv, "--output-len", "8", "--max-concurrency", "4", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    for side in ("serving", "offline"):
        assert (report[side]["completed"], report[side]["failed"]) == (8, 0), side
        assert report[side]["total_output_tokens"] == 8 * 8
    assert report["serving"]["model"] == "tiny-random"
    assert report["ratio"] > 0 and "serving / offline output tok/s" in capsys.readouterr().out
