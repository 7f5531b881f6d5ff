"""`triode serve` under load and faults, on real server processes running the random-weight
`tiny-random` model (its cost is next to nothing, so these tests load the server, not the
model): hundreds of concurrent streams with a third of the clients walking away, a reader that
stops reading, the engine core killed mid-load, and bad requests that must never reach the
engine."""

from __future__ import annotations

import array
import fcntl
import json
import os
import random
import signal
import socket
import statistics
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from server import Server, running_server

from triode.edge.sse import SSEParser

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
MAX_BODY = 64 << 10
TINY_ARGS = [MODEL, "--max-num-seqs", "256", "--max-body-size", "64KiB"]
COMPLETIONS = "/v1/completions"
# Pool limits high enough that every client of a test gets its own connection at once.
LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("tiny") / "serve.log"
    with running_server(TINY_ARGS, log) as server:
        yield server


@dataclass
class _Model:
    vocab_size: int
    max_model_len: int


@pytest.fixture(scope="module")
def model(tiny: Server) -> _Model:
    """tiny-random's sizes: its vocabulary is the default model's or a byte-level one,
    depending on what was in the cache when it was built."""
    from triode.gpu.loader import resolve_model

    config = json.loads((resolve_model(MODEL) / "config.json").read_text())
    [card] = httpx.get(f"{tiny.url}/v1/models", timeout=10).json()["data"]
    return _Model(config["vocab_size"], card["max_model_len"])


def _client(server: Server, timeout: float = 60) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, limits=LIMITS, timeout=timeout)


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """Every `triode:` sample of /metrics, summed over labels other than the model's."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith("triode:") and not sample.name.endswith("_created"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def _poll(check: Callable[[], Awaitable[bool]], seconds: float) -> bool:
    """Whether `check()` comes true within `seconds`, asking every 50 ms."""
    with trio.move_on_after(seconds):
        while True:
            if await check():
                return True
            await trio.sleep(0.05)
    return False


async def _wait_until_idle(client: httpx.AsyncClient, seconds: float = 5.0) -> dict[str, float]:
    """/metrics once no request runs and the KV cache is empty, or after `seconds`."""
    latest: dict[str, float] = {}

    async def idle() -> bool:
        latest.update(await _metrics(client))
        return latest["triode:num_requests_running"] == 0 == latest["triode:kv_cache_usage_perc"]

    await _poll(idle, seconds)
    return latest


def _stream_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "logprobs": 0, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip


@dataclass
class _Stream:
    """What a client saw of one SSE stream."""

    events: list[bytes] = field(default_factory=list)
    token_chunks: int = 0  # events that carried generated tokens
    tokens: int = 0  # tokens they carried, counted by their logprobs entries
    seconds: float = 0.0

    def feed(self, events: list[bytes]) -> None:
        self.events += events
        for data in events:
            if data == b"[DONE]":
                continue
            choices = json.loads(data).get("choices") or []
            tokens = sum(len((c.get("logprobs") or {}).get("tokens", ())) for c in choices)
            self.token_chunks += bool(tokens)
            self.tokens += tokens

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == b"[DONE]"

    def usage(self) -> dict[str, int]:
        usage: dict[str, int] = json.loads(self.events[-2])["usage"]
        return usage


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> _Stream:
    """POST a streaming completion and read it to its end."""
    seen = _Stream()
    started = time.perf_counter()
    async with client.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200, await response.aread()
        parser = SSEParser()
        async for data in response.aiter_bytes():
            seen.feed(parser.feed(data))
    seen.seconds = time.perf_counter() - started
    return seen


def _http_request(server: Server, body: dict[str, Any]) -> tuple[h11.Connection, bytes]:
    """A client-side h11 connection and the bytes of a POST of `body` to /v1/completions."""
    payload = json.dumps(body).encode()
    connection = h11.Connection(h11.CLIENT)
    headers = [
        ("host", server.url.removeprefix("http://")),
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
    ]
    wire = connection.send(h11.Request(method="POST", target=COMPLETIONS, headers=headers))
    wire += connection.send(h11.Data(data=payload)) + connection.send(h11.EndOfMessage())
    return connection, wire


async def _hang_up_after(server: Server, body: dict[str, Any], tokens: int) -> _Stream:
    """POST a streaming completion over a plain socket and close the socket once `tokens`
    tokens have arrived, as a client that goes away mid-stream does. (Counted in tokens, not
    chunks: a loaded server coalesces several tokens into one chunk.)"""
    seen = _Stream()
    connection, request = _http_request(server, body)
    host, port = server.url.removeprefix("http://").split(":")
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(request)
        parser = SSEParser()
        while seen.tokens < tokens:
            data = await stream.receive_some()
            assert data, "the stream ended early"
            connection.receive_data(data)
            while (event := connection.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.Response):
                    assert event.status_code == 200
                elif isinstance(event, h11.Data):
                    seen.feed(parser.feed(bytes(event.data)))
    return seen


def _assert_complete(seen: _Stream, max_tokens: int) -> None:
    assert seen.done, seen.events[-3:]
    usage = seen.usage()
    assert usage["completion_tokens"] == max_tokens
    assert seen.tokens == max_tokens
    last = json.loads(seen.events[-3])["choices"][-1]
    assert last["finish_reason"] == "length"


def _unread_bytes(sock: trio.socket.SocketType) -> int:
    """How much has arrived on `sock` that nobody has read."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _main_thread_wakeups(pid: int) -> int:
    """How often the process's main thread has gone to sleep and been woken: an idle engine core
    sleeps in its event loop until a message arrives, so any message it receives moves this."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no context switch count for {pid}")


# Many streams


async def test_256_streams_with_a_third_disconnecting_finish_and_free_everything(
    tiny: Server,
) -> None:
    rng = random.Random(256)
    clients = 256
    leavers = set(rng.sample(range(clients), clients // 3))
    # a leaver's stream is long enough that it cannot end before the leaver has read its part,
    # however busy this process is: new requests start over several steps, so the first ones
    # run at full speed while the last are still being sent
    max_tokens = [512 if i in leavers else rng.randint(32, 64) for i in range(clients)]
    stop_after = {i: rng.randint(1, 32) for i in leavers}
    results: dict[int, _Stream] = {}

    async with _client(tiny) as client:
        before = await _metrics(client)

        async def one(i: int) -> None:
            body = _stream_body(f"Request {i}: tell me a story.", max_tokens[i])
            if i in leavers:
                results[i] = await _hang_up_after(tiny, body, stop_after[i])
            else:
                results[i] = await _stream(client, body)

        started = time.perf_counter()
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                for i in range(clients):
                    nursery.start_soon(one, i)
        wall = time.perf_counter() - started

        for i, seen in results.items():
            if i in leavers:
                assert not seen.done and seen.tokens >= stop_after[i]
            else:
                _assert_complete(seen, max_tokens[i])
        after = await _wait_until_idle(client)
        assert after["triode:num_requests_running"] == 0
        assert after["triode:kv_cache_usage_perc"] == 0
        assert (await client.get("/health")).status_code == 200

    finished = [i for i in range(clients) if i not in leavers]
    delivered = sum(results[i].tokens for i in range(clients))
    chunks = sum(results[i].token_chunks for i in finished)
    tokens = sum(max_tokens[i] for i in finished)
    generated = after["triode:generation_tokens_total"] - before["triode:generation_tokens_total"]
    assert generated == tokens  # the edge counts finished requests only
    latencies = sorted(results[i].seconds for i in finished)
    print(
        f"\n256 streams: {wall:.2f}s wall, {delivered / wall:.0f} tokens/s delivered "
        f"({delivered} tokens, {len(finished)} finished, {len(leavers)} disconnected), "
        f"{chunks} token chunks for {tokens} tokens, latency p50 "
        f"{statistics.median(latencies):.2f}s max {latencies[-1]:.2f}s"
    )


# A reader that stops reading


async def _batch_latencies(client: httpx.AsyncClient, count: int, max_tokens: int) -> list[float]:
    latencies: list[float] = []

    async def one(i: int) -> None:
        seen = await _stream(client, _stream_body(f"Quick {i}", max_tokens))
        _assert_complete(seen, max_tokens)
        latencies.append(seen.seconds)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return sorted(latencies)


async def test_a_reader_that_stops_reading_holds_bounded_memory_and_delays_no_one(
    tiny: Server, model: _Model
) -> None:
    pid = tiny.process.pid
    port = int(tiny.url.rsplit(":", 1)[1])
    async with _client(tiny) as client:
        await _batch_latencies(client, 8, 32)  # warm up
        alone = [t for _ in range(3) for t in await _batch_latencies(client, 8, 32)]

        slow = trio.socket.socket()
        # A small receive window: the server's writes block as soon as its own buffer is full.
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await slow.connect(("127.0.0.1", port))
        # Four sequences of ~2000 tokens with 5 logprobs each: megabytes of events, far more
        # than the kernel buffers between the two ends.
        body = _stream_body("Never read me.", model.max_model_len - 64, n=4, logprobs=5)
        _, request = _http_request(tiny, body)
        await slow.send(request)

        async def all_running() -> bool:
            return (await _metrics(client))["triode:num_requests_running"] >= 4

        assert await _poll(all_running, 10)

        rss = [_rss_mb(pid)]
        beside: list[float] = []
        for _ in range(3):
            with trio.fail_after(30):
                beside += await _batch_latencies(client, 8, 32)
            rss.append(_rss_mb(pid))
        for _ in range(8):
            await trio.sleep(0.25)
            rss.append(_rss_mb(pid))
        running = (await _metrics(client))["triode:num_requests_running"]
        unread = _unread_bytes(slow)
        slow.close()

        after = await _wait_until_idle(client)
        assert after["triode:num_requests_running"] == 0
        assert after["triode:kv_cache_usage_perc"] == 0
        assert (await client.get("/health")).status_code == 200

    base, loaded = statistics.median(alone), statistics.median(beside)
    growth = max(rss) - rss[0]
    print(
        f"\nslow reader: 3 x 8 x 32-token streams p50 {base:.3f}s (max {max(alone):.3f}s) "
        f"alone, {loaded:.3f}s (max {max(beside):.3f}s) beside it; "
        f"edge RSS MB {[round(r, 1) for r in rss]} (growth {growth:.1f} MB); "
        f"{running:.0f} sequences still running and {unread} bytes unread when it closed"
    )
    assert loaded < 4 * base + 1.0
    assert growth < 50


# The engine core killed mid-load


async def test_killing_the_engine_ends_every_stream_at_once_and_a_restart_serves(
    tmp_path: Path, model: _Model
) -> None:
    with running_server(TINY_ARGS, tmp_path / "serve.log") as server:
        async with _client(server, timeout=30) as client:
            first_chunk = [trio.Event() for _ in range(16)]
            ended: dict[int, float] = {}
            seen: dict[int, _Stream] = {}

            async def one(i: int) -> None:
                body = _stream_body(f"Stream {i}", model.max_model_len - 64)
                s = seen[i] = _Stream()
                async with client.stream("POST", COMPLETIONS, json=body) as response:
                    assert response.status_code == 200
                    parser = SSEParser()
                    async for data in response.aiter_bytes():
                        s.feed(parser.feed(data))
                        if s.tokens:
                            first_chunk[i].set()
                ended[i] = time.monotonic()

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for i in range(16):
                        nursery.start_soon(one, i)
                    for event in first_chunk:
                        await event.wait()
                    os.kill(server.engine_pid(), signal.SIGKILL)
                    killed = time.monotonic()

            times = [ended[i] - killed for i in range(16)]
            assert max(times) < 2.0
            for s in seen.values():
                assert s.done
                error = json.loads(s.events[-2])["error"]
                assert error["code"] == 503 and "engine" in error["message"]
                assert 0 < s.tokens < model.max_model_len - 64

            async def unhealthy() -> bool:
                return (await client.get("/health")).status_code == 503

            assert await _poll(unhealthy, 2)
            refused = await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 4})
            assert refused.status_code == 503
            streamed = await client.post(COMPLETIONS, json=_stream_body("Hi", 4))
            assert streamed.status_code == 503

        server.process.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        assert await trio.to_thread.run_sync(server.process.wait, 30) == 0
        stop_seconds = time.monotonic() - stopped

    with running_server(TINY_ARGS, tmp_path / "again.log") as server:
        async with _client(server) as client:
            _assert_complete(await _stream(client, _stream_body("Again", 16)), 16)
    print(
        f"\nengine killed: 16 streams ended {min(times):.3f}-{max(times):.3f}s after the kill; "
        f"the server stopped {stop_seconds:.2f}s after SIGINT"
    )


# Bad requests


def _bad_requests(vocab: int, context: int) -> list[tuple[str, dict[str, Any] | bytes, int]]:
    """(path, body, status): requests the edge must refuse on its own."""
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": "Hello"}]
    padded = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    return [
        (COMPLETIONS, padded + b" " * MAX_BODY, 413),
        (chat, json.dumps({"messages": messages, "max_tokens": 1}).encode() + b" " * MAX_BODY, 413),
        (COMPLETIONS, {"prompt": "x" * MAX_BODY, "max_tokens": 1}, 413),
        (COMPLETIONS, b"{not json", 400),
        (COMPLETIONS, b"", 400),
        (chat, b"[1, 2, 3]", 400),
        (COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1', 400),
        (COMPLETIONS, {"prompt": 5, "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": "Hello", "max_tokens": "many"}, 400),
        (COMPLETIONS, {"prompt": [1, "two"], "max_tokens": 1}, 400),
        (chat, {"messages": "Hello"}, 400),
        (chat, {"messages": [{"role": "user", "content": 5}]}, 400),
        (COMPLETIONS, {"prompt": "hello " * (context + 1), "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": [1] * context, "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": [1] * 100, "max_tokens": context}, 400),
        (chat, {"messages": [{"role": "user", "content": "hello " * (context + 1)}]}, 400),
        (COMPLETIONS, {"prompt": [1, 2, vocab], "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 10**12]], "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": [-1], "max_tokens": 1}, 400),
        (COMPLETIONS, {"prompt": "Hello", "stop_token_ids": [vocab]}, 400),
        (COMPLETIONS, {"prompt": "Hello", "logit_bias": {str(vocab): 1}}, 400),
        (COMPLETIONS, {"prompt": "Hello", "logit_bias": {"-1": 1}}, 400),
        (chat, {"messages": messages, "allowed_token_ids": [vocab]}, 400),
        (COMPLETIONS, {"prompt": "Hello", "n": 0}, 400),
        (COMPLETIONS, {"prompt": "Hello", "n": 129}, 400),
        (chat, {"messages": messages, "n": 10**9}, 400),
        (COMPLETIONS, {"prompt": "Hello", "n": 2.5}, 400),
    ]


async def test_bad_requests_are_refused_before_the_engine(tiny: Server, model: _Model) -> None:
    engine = tiny.engine_pid()
    bad = _bad_requests(model.vocab_size, model.max_model_len)
    async with _client(tiny) as client:
        before = await _wait_until_idle(client)
        await trio.sleep(0.2)  # the metrics call above woke the engine; let it settle
        wakeups = _main_thread_wakeups(engine)
        statuses = []
        for path, body, _ in bad:
            if isinstance(body, bytes):
                response = await client.post(path, content=body)
            else:
                response = await client.post(path, json=body)
            assert response.json()["error"]["code"] == response.status_code
            statuses.append(response.status_code)
        await trio.sleep(0.2)
        assert _main_thread_wakeups(engine) == wakeups
        after = await _metrics(client)
        assert statuses == [status for _, _, status in bad]
        for name in (
            "triode:prompt_tokens_total",
            "triode:generation_tokens_total",
            "triode:request_success_total",
            "triode:e2e_request_latency_seconds_count",
        ):
            assert after[name] == before[name], name
        good = await client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2})
        assert good.status_code == 200
        assert _main_thread_wakeups(engine) > wakeups
        assert tiny.engine_pid() == engine
