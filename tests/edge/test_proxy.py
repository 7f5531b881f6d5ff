"""`triode proxy`: prefill for one token, decode with the prefill's KV parameters, relayed as it
arrives; round robin, skipped and missing instances, auth, health, and the client leaving.

The instances are small ASGI apps under hypercorn on loopback ports, in the test's own trio run;
the proxy is `serve_proxy` beside them (or `triode proxy`, as a process, in one test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from kv_secret import secret_file

from triode.edge.auth import ApiKeys
from triode.edge.cli import build_parser
from triode.edge.proxy import PREFILL_KV_PARAMS, ProxyOptions, serve_proxy
from triode.edge.upstream import base_url
from triode.wire.kv_seal import verify_remote_decode
from triode.wire.ports import free_port

WORDS = ["Hello", " from", " the", " decode"]
SECRET = b"0123456789abcdef" * 4  # the deployment's


@dataclass
class Instance:
    """A stand-in for a triode instance: records what it is sent, answers as a prefill (a whole
    completion with `kv_transfer_params`) or a decode (the same, or an SSE stream) would."""

    name: str
    calls: list[str] = field(default_factory=list)  # shared: the order instances were called in
    kv_params: dict[str, Any] | None = None
    status: int = 200
    health: int = 200
    gate: trio.Event | None = None  # a stream waits for it after its first chunk
    hold: bool = False  # a stream waits for the client to leave after its first chunk
    stall: bool = False  # never answers a generation request
    break_off: bool = False  # a stream fails after its first chunk
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[bytes, bytes]] = field(default_factory=list)
    chunks_sent: int = 0
    disconnected: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        if self.kv_params is None and self.name.startswith("p"):
            self.kv_params = {"do_remote_prefill": True, "remote_engine_id": self.name,
                              "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                              "remote_port": 5600}  # fmt: skip

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            await _respond(send, self.health, b"")
            return
        if path == "/v1/models":
            await _respond(send, 200, json.dumps({"object": "list", "data": [
                {"id": self.name, "object": "model", "created": 0, "owned_by": "triode"}
            ]}).encode())  # fmt: skip
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.calls.append(self.name)
        self.bodies.append(request)
        self.headers.append(dict(scope["headers"]))
        if self.stall:
            await trio.sleep_forever()
        if self.status != 200:
            error = {"message": f"refused by {self.name}", "type": "BadRequestError",
                     "param": "prompt", "code": self.status}  # fmt: skip
            await _respond(send, self.status, json.dumps({"error": error}).encode())
        elif request.get("stream"):
            await self._stream(path, receive, send)
        else:
            await _respond(send, 200, json.dumps(self._completion(path)).encode())

    def _completion(self, path: str) -> dict[str, Any]:
        text = f"{self.name} answers"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        completion: dict[str, Any] = {"id": f"{self.name}-1", "object": "text_completion",
                                      "created": 0, "model": "m", "choices": [choice]}  # fmt: skip
        if self.kv_params is not None:
            completion["kv_transfer_params"] = self.kv_params
        return completion

    async def _stream(self, path: str, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i, word in enumerate(WORDS):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
            if path == "/v1/chat/completions":
                choice["delta"] = {"content": word}
            else:
                choice["text"] = word
            chunk = {"id": "s", "object": "chunk", "created": 0, "model": "m", "choices": [choice]}
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
            self.chunks_sent += 1
            if i == 0 and self.hold:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected.set()
                return
            if i == 0 and self.break_off:
                raise RuntimeError("the instance died mid-stream")
            if i == 0 and self.gate is not None:
                await self.gate.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _respond(send: Callable, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Cluster:
    url: str
    prefill: list[Instance]
    decode: list[Instance]
    calls: list[str]


async def start_cluster(
    nursery: trio.Nursery,
    prefill: int = 1,
    decode: int = 1,
    *,
    dead_prefill: tuple[int, ...] = (),
    dead_decode: tuple[int, ...] = (),
    **options: Any,
) -> Cluster:
    """`prefill` + `decode` instances behind a proxy; the positions in `dead_*` get a URL that
    nothing listens on instead."""
    calls: list[str] = []
    kinds: dict[str, tuple[list[Instance], list[str]]] = {}
    for kind, count, dead in (("p", prefill, dead_prefill), ("d", decode, dead_decode)):
        instances = [Instance(f"{kind}{i}", calls) for i in range(count)]
        urls = [await _serve_app(nursery, instance) for instance in instances]
        for position in dead:
            urls.insert(position, f"http://127.0.0.1:{free_port()}")
        kinds[kind] = instances, urls
    options.setdefault("kv_secret", SECRET)
    proxy = ProxyOptions(prefill=kinds["p"][1], decode=kinds["d"][1], port=0, **options)
    [url] = await nursery.start(serve_proxy, proxy)
    return Cluster(url, kinds["p"][0], kinds["d"][0], calls)


async def _serve_app(nursery: trio.Nursery, app: Instance) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    [url] = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
    return url


def _client(url: str, api_key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


async def _post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return await client.post(path, json=body, **kwargs)


def _error(response: httpx.Response) -> dict[str, Any]:
    detail = response.json()["error"]
    assert set(detail) == {"message", "type", "param", "code"}
    return detail


async def test_a_completion_is_prefilled_for_one_token_then_decoded_with_the_prefills_kv(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery)
    async with _client(cluster.url) as client:
        reply = await client.completions.create(model="m", prompt="Hi", max_tokens=5, n=2)
    assert reply.choices[0].text == "d0 answers"
    sent = {"model": "m", "prompt": "Hi", "max_tokens": 5, "n": 2}
    [prefilled] = cluster.prefill[0].bodies
    asked = prefilled.pop("kv_transfer_params")
    assert prefilled == {**sent, "max_tokens": 1, "n": 1, "stream": False}
    assert asked.items() >= PREFILL_KV_PARAMS.items() and asked["do_remote_decode"] is True
    assert verify_remote_decode(SECRET, asked) is None  # sealed by the proxy
    assert verify_remote_decode(b"another deployment's secret!!!!!", asked) is not None
    [decoded] = cluster.decode[0].bodies
    assert decoded == {**sent, "kv_transfer_params": cluster.prefill[0].kv_params}
    assert cluster.calls == ["p0", "d0"]


async def test_a_chat_stream_is_relayed_chunk_by_chunk_and_reassembles(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery)
    decode = cluster.decode[0]
    gate = decode.gate = trio.Event()

    def read_stream() -> list[str | None]:
        # the sync client: the async one leaves its stream's generators unfinished under trio
        with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="k", max_retries=0) as client:
            stream = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Hi"}],
                max_completion_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
            texts = []
            for chunk in stream:
                # the decode holds the rest back until the first chunk got through on its own
                assert decode.chunks_sent == 1 or gate.is_set()
                trio.from_thread.run_sync(gate.set)
                texts.append(chunk.choices[0].delta.content)
            return texts

    with trio.fail_after(10):
        assert await trio.to_thread.run_sync(read_stream) == WORDS
    [prefilled] = cluster.prefill[0].bodies
    assert (prefilled["max_tokens"], prefilled["max_completion_tokens"]) == (1, 1)
    assert prefilled["stream"] is False and "stream_options" not in prefilled
    assert prefilled["kv_transfer_params"]["do_remote_decode"] is True
    [decoded] = decode.bodies
    assert decoded["stream"] is True and decoded["stream_options"] == {"include_usage": True}
    assert decoded["max_completion_tokens"] == 7 and "max_tokens" not in decoded
    assert decoded["kv_transfer_params"] == cluster.prefill[0].kv_params


async def test_a_completion_stream_arrives_as_the_decodes_sse_bytes(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery)

    def read_stream() -> list[str]:
        with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="k", max_retries=0) as client:
            stream = client.completions.create(model="m", prompt="Hi", stream=True)
            return [chunk.choices[0].text for chunk in stream]

    assert await trio.to_thread.run_sync(read_stream) == WORDS
    async with httpx.AsyncClient(timeout=5) as client:
        body = {"model": "m", "prompt": "Hi", "stream": True}
        response = await client.post(f"{cluster.url}/v1/completions", json=body)
    assert response.headers["content-type"] == "text/event-stream"
    assert response.text.count("data: ") == len(WORDS) + 1
    assert response.text.endswith("data: [DONE]\n\n")


async def test_round_robin_alternates_over_each_kind_separately(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, prefill=2, decode=2)
    for _ in range(4):
        response = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
        assert response.status_code == 200
    assert cluster.calls == ["p0", "d0", "p1", "d1", "p0", "d0", "p1", "d1"]
    engines = [body["kv_transfer_params"]["remote_engine_id"]
               for decode in cluster.decode for body in decode.bodies]  # fmt: skip
    assert engines == ["p0", "p0", "p1", "p1"]  # each decode took its own prefill's KV


async def test_an_instance_that_refuses_the_connection_is_skipped(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, dead_prefill=(0,), dead_decode=(1,))
    for _ in range(3):
        response = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
        assert response.status_code == 200
    assert cluster.calls == ["p0", "d0"] * 3
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{cluster.url}/metrics")).text
    assert 'triode:proxy_upstream_failures_total{kind="prefill"} 2.0' in metrics
    assert 'triode:proxy_upstream_failures_total{kind="decode"} 1.0' in metrics


@pytest.mark.parametrize("kind", ["prefill", "decode"])
async def test_no_reachable_instance_of_a_kind_answers_502_naming_it(
    nursery: trio.Nursery, kind: str
) -> None:
    dead = {"prefill": 0, "dead_prefill": (0, 1)} if kind == "prefill" else {
        "decode": 0, "dead_decode": (0, 1)}  # fmt: skip
    cluster = await start_cluster(nursery, **dead)
    response = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
    assert response.status_code == 502
    message = _error(response)["message"]
    assert message.startswith(f"no {kind} instance reachable: http://127.0.0.1:")
    assert message.count("http://") == 2
    assert cluster.calls == ([] if kind == "prefill" else ["p0"])


async def test_a_prefill_error_is_relayed_and_nothing_is_decoded(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    cluster.prefill[0].status = 400
    async with _client(cluster.url) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="m", prompt="Hi", stream=True)
    assert caught.value.status_code == 400
    assert caught.value.body == {"message": "refused by p0", "type": "BadRequestError",
                                 "param": "prompt", "code": 400}  # fmt: skip
    assert cluster.calls == ["p0"]


async def test_a_prefill_without_kv_params_is_decoded_from_scratch_with_one_warning(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(nursery)
    cluster.prefill[0].kv_params = None
    for _ in range(2):
        response = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
        assert response.json()["choices"][0]["text"] == "d0 answers"
    assert [body["kv_transfer_params"] for body in cluster.decode[0].bodies] == [None, None]
    warnings = [r for r in caplog.records if "no kv_transfer_params" in r.getMessage()]
    assert len(warnings) == 1 and "KV producer" in warnings[0].getMessage()


async def test_a_prefill_slower_than_the_timeout_answers_504(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, timeout=0.2)
    cluster.prefill[0].stall = True
    response = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
    assert response.status_code == 504
    assert _error(response)["message"].startswith("the prefill instance http://127.0.0.1:")
    assert cluster.calls == ["p0"]


async def test_a_key_is_required_and_the_clients_authorization_is_kept_from_the_instances(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, api_keys=ApiKeys(["secret"]))
    refused = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert _error(refused)["type"] == "AuthenticationError"
    wrong = await _post(cluster.url, "/v1/completions", {"prompt": "Hi"},
                        headers={"authorization": "Bearer guess"})  # fmt: skip
    assert wrong.status_code == 401
    assert cluster.calls == []
    async with _client(cluster.url, api_key="secret") as client:
        reply = await client.completions.create(model="m", prompt="Hi")
    assert reply.choices[0].text == "d0 answers"
    instances = (*cluster.prefill, *cluster.decode)
    assert [b"authorization" in i.headers[0] for i in instances] == [False, False]


async def test_forward_client_key_sends_the_clients_authorization_on(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, api_keys=ApiKeys(["secret"]), forward_client_key=True)
    async with _client(cluster.url, api_key="secret") as client:
        await client.completions.create(model="m", prompt="Hi")
    instances = (*cluster.prefill, *cluster.decode)
    assert [i.headers[0][b"authorization"] for i in instances] == [b"Bearer secret"] * 2


async def test_a_backend_key_replaces_the_clients_toward_the_instances(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, api_keys=ApiKeys(["secret"]), backend_api_key="inner")
    response = await _post(cluster.url, "/v1/chat/completions", {"messages": []},
                           headers={"authorization": "Bearer secret"})  # fmt: skip
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "d0 answers"
    instances = (*cluster.prefill, *cluster.decode)
    assert [i.headers[0][b"authorization"] for i in instances] == [b"Bearer inner"] * 2


async def test_health_needs_one_healthy_instance_of_each_kind(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, prefill=1, decode=2, dead_prefill=(0,))
    async with httpx.AsyncClient(base_url=cluster.url, timeout=5) as client:
        assert (await client.get("/health")).status_code == 200
        cluster.decode[0].health = 503
        assert (await client.get("/health")).status_code == 200
        cluster.decode[1].health = 500
        unhealthy = await client.get("/health")
        assert unhealthy.status_code == 503
        assert _error(unhealthy)["message"] == "no healthy decode instance (of 2)"
        cluster.prefill[0].health = 503
        both = _error(await client.get("/health"))["message"]
        assert both == "no healthy prefill instance (of 2); no healthy decode instance (of 2)"


async def test_a_client_that_leaves_mid_stream_disconnects_the_decode(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery)
    decode = cluster.decode[0]
    decode.hold = True
    body = json.dumps({"prompt": "Hi", "stream": True}).encode()
    host, port = cluster.url.removeprefix("http://").split(":")
    with trio.fail_after(10):
        # a raw socket: an HTTP client would leave its own stream half read
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\n"
                b"content-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            received = b""
            while b"data: " not in received:
                received += await stream.receive_some()
        assert received.startswith(b"HTTP/1.1 200")
        await decode.disconnected.wait()
    assert decode.chunks_sent == 1


async def test_a_decode_that_breaks_off_mid_stream_breaks_off_the_clients_stream(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery)
    cluster.decode[0].break_off = True
    with trio.fail_after(10), pytest.raises(httpx.RemoteProtocolError):
        await _post(cluster.url, "/v1/completions", {"prompt": "Hi", "stream": True})
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{cluster.url}/metrics")).text
    assert 'triode:proxy_upstream_failures_total{kind="decode"} 1.0' in metrics


async def test_models_come_from_a_decode_instance(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, decode=2)
    async with _client(cluster.url) as client:
        first = await client.models.list()
        second = await client.models.list()
    assert [m.id for m in first.data] == ["d0"] and [m.id for m in second.data] == ["d1"]


async def test_bad_requests_get_the_openai_error_shape_and_reach_no_instance(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, max_body_size=100)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=5) as client:
        missing = await client.get("/v1/embeddings")
        assert (missing.status_code, _error(missing)["type"]) == (404, "NotFoundError")
        wrong = await client.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "OPTIONS, POST"
        invalid = await client.post("/v1/completions", content=b"{")
        assert invalid.status_code == 400
        assert _error(invalid)["message"].startswith("invalid JSON")
        array = await client.post("/v1/completions", json=[1, 2])
        assert _error(array)["message"] == "the request body must be a JSON object"
        large = await client.post("/v1/completions", json={"prompt": "x" * 200})
        assert (large.status_code, _error(large)["type"]) == (413, "RequestTooLarge")
        options = await client.options("/v1/chat/completions")
        assert options.status_code == 204 and options.headers["allow"] == "OPTIONS, POST"
        metrics = (await client.get("/metrics")).text
    assert cluster.calls == []
    assert 'triode:proxy_requests_total{route="/v1/completions",status="400"} 2.0' in metrics
    assert 'triode:proxy_requests_total{route="other",status="404"} 1.0' in metrics


async def test_a_deeply_nested_body_is_a_400_without_internals(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    deep = b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await _post(cluster.url, "/v1/completions", None, content=deep)
    assert response.status_code == 400
    assert _error(response)["message"] == "the request body is nested too deeply"
    assert cluster.calls == []


async def test_a_clients_own_kv_transfer_params_reach_no_instance(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "seal": "00"}
    response = await _post(
        cluster.url, "/v1/completions", {"prompt": "Hi", "kv_transfer_params": forged}
    )
    assert response.status_code == 200
    [prefilled], [decoded] = cluster.prefill[0].bodies, cluster.decode[0].bodies
    assert prefilled["kv_transfer_params"]["do_remote_decode"] is True
    assert decoded["kv_transfer_params"] == cluster.prefill[0].kv_params


def test_the_proxy_needs_the_deployments_secret(tmp_path: Path) -> None:
    for secret in (b"", b"short"):
        with pytest.raises(ValueError, match="secret"):
            ProxyOptions(prefill=["http://h:1"], decode=["http://h:2"], kv_secret=secret)
    with pytest.raises(ValueError, match="not both"):
        ProxyOptions(prefill=["http://h:1"], decode=["http://h:2"], kv_secret=SECRET,
                     backend_api_key="k", forward_client_key=True)  # fmt: skip
    with pytest.raises(SystemExit):  # --kv-secret-file is required
        build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2"])
    loose = tmp_path / "kv.secret"
    loose.write_bytes(SECRET)
    loose.chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "proxy", "--prefill", "http://a:1",
         "--decode", "http://b:2", "--kv-secret-file", str(loose)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"triode proxy: secret file {loose} is accessible by group or others (mode 0644); "
        f"chmod 600 {loose}"
    ]


def test_instance_urls_are_bases_with_or_without_v1() -> None:
    assert base_url("http://127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert base_url(" http://h:8100/v1/ ") == "http://h:8100"
    assert base_url("https://h/prefix/v1") == "https://h/prefix"
    for bad in ("127.0.0.1:8100", "ftp://h", "http://"):
        with pytest.raises(ValueError, match="URL"):
            base_url(bad)
    with pytest.raises(ValueError, match="one prefill and one decode"):
        ProxyOptions(prefill=["http://h:1"], decode=[], kv_secret=SECRET)


def test_the_proxy_command_line_takes_both_kinds_and_the_serve_spellings() -> None:
    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3",
         "--decode", "http://d:4", "--api-key", "k", "--backend-api-key", "inner",
         "--timeout", "30", "--kv-secret-file", "kv.secret"]
    )  # fmt: skip
    assert args.prefill == ["http://a:1", "http://b:2"]
    assert args.decode == ["http://c:3", "http://d:4"]
    assert (args.api_key, args.backend_api_key, args.timeout) == (["k"], "inner", 30.0)
    assert (args.host, args.port, args.log_level) == ("127.0.0.1", 8000, "info")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--kv-secret-file", "f"])


async def test_triode_proxy_serves_and_stops_on_sigint(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill, decode = Instance("p0"), Instance("d0")
    prefill_url = await _serve_app(nursery, prefill)
    decode_url = await _serve_app(nursery, decode)
    port = free_port()
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "triode.edge.cli", "proxy", "--prefill", f"{prefill_url}/v1/",
             "--decode", decode_url, "--port", str(port), "--kv-secret-file",
             secret_file(tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRIODE_API_KEY": "from-env"},
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            with trio.fail_after(30):
                while True:
                    assert process.poll() is None, log.read_text()
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await trio.sleep(0.1)
            headers = {"authorization": "Bearer from-env"}
            response = await client.post("/v1/completions", json={"prompt": "Hi"},
                                         headers=headers)  # fmt: skip
        assert response.json()["choices"][0]["text"] == "d0 answers"
        assert prefill.bodies[0]["max_tokens"] == 1
        process.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            assert await process.wait() == 0
    finally:
        if process.poll() is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0
    output = log.read_text()
    assert "API keys required: 1 configured" in output and "proxy stopped" in output
