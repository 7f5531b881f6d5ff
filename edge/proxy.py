"""`triode proxy`: disaggregated prefill, one OpenAI endpoint in front of prefill and decode
instances.

A generation request goes first to a prefill instance, as a copy that asks for one token, not
streamed, and for its KV cache to be kept for a remote decode; the prefill answers with
`kv_transfer_params` naming those blocks. The original request then goes to a decode instance
with those parameters, and the decode's answer (a stream, relayed chunk by chunk as it arrives,
or a whole body) goes back to the client. A prefill that answers an error status has that answer
relayed, and no decode is asked. A prefill instance that is not a KV producer answers without
`kv_transfer_params`; its request is then decoded from scratch.

The proxy is a member of the deployment: it seals the `do_remote_decode` params it sends a
prefill with the deployment's secret (`--kv-secret-file`), without which a prefill keeps no
blocks, and relays the prefill's sealed params to the decode unchanged. The client's
Authorization header is its own business with the proxy: toward the instances goes
`--backend-api-key`, or the client's only with `--forward-client-key`, else none.

Each kind of instance is taken in turn (round robin); one that refuses the connection, or does
not accept it within the connect timeout, is skipped for the next of its kind. The whole
exchange runs beside a task that watches for `http.disconnect`: a client that goes away cancels
it, which closes the upstream connection, so the instance sees the disconnect and aborts too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from triode.wire.kv_seal import MIN_SECRET_BYTES, SECRET_RECIPE, seal_remote_decode

from .asgi_server import serve_asgi
from .auth import UNAUTHORIZED_HEADERS, ApiKeys, requires_auth
from .errors import APIError, validation_error
from .http import (
    ClientDisconnected,
    Headers,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    encode_json,
    respond,
    respond_error,
)
from .routing import allow, lifespan, method_not_allowed, routed_path
from .upstream import Instances, base_url, describe

log = logging.getLogger("triode.proxy")

Handler = Callable[["Proxy", Request], Awaitable[None]]

# What a prefill instance is told: compute the prompt's KV and keep it for a decode elsewhere.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Response headers worth relaying; the others (date, server, framing) are the proxy's own.
_RELAYED = ("content-type", "content-length", "content-encoding")

# Connections to the instances kept open while idle, for reuse; more may be open while busy.
_IDLE_CONNECTIONS = 64


@dataclass
class ProxyOptions:
    """Where the instances are, where to listen, and how long to wait for whom."""

    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys(()))
    backend_api_key: str | None = None
    timeout: float = 600.0  # for each read from an instance: a generation can be long
    connect_timeout: float = 5.0
    health_timeout: float = 2.0
    max_body_size: int = 16 << 20
    graceful_timeout: float = 10.0
    # the deployment's secret (`kv_seal.read_secret`), which seals do_remote_decode requests
    kv_secret: bytes = b""
    forward_client_key: bool = False  # send the client's Authorization on to the instances

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one prefill and one decode instance are needed")
        if len(self.kv_secret) < MIN_SECRET_BYTES:
            raise ValueError(
                "the deployment's KV secret is needed (--kv-secret-file, the file the "
                f"instances' secret_file names); make one with: {SECRET_RECIPE}"
            )
        if self.forward_client_key and self.backend_api_key:
            raise ValueError("give --backend-api-key or --forward-client-key, not both")
        self.prefill = [base_url(url) for url in self.prefill]
        self.decode = [base_url(url) for url in self.decode]


class _Metrics:
    """The proxy's own counters, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "triode:proxy_requests",
            "Requests answered, by route and status (499: the client left first).",
            ("route", "status"),
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "triode:proxy_upstream_failures",
            "Requests to instances that failed (refused, timed out, broken), by kind.",
            ("kind",),
            registry=self.registry,
        )
        for kind in ("prefill", "decode"):
            self.upstream_failures.labels(kind)


class Proxy:
    """The ASGI app: one OpenAI endpoint over prefill and decode instances.

    `client` is shared by all requests (its connections are pooled) and stays open while the
    app serves; whoever made it closes it.
    """

    def __init__(self, options: ProxyOptions, client: httpx.AsyncClient) -> None:
        self.options = options
        self.client = client
        self.prefill = Instances("prefill", options.prefill)
        self.decode = Instances("decode", options.decode)
        self.metrics = _Metrics()
        self._not_producers: set[str] = set()  # prefill instances already warned about

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = routed_path(scope)
        status = 499

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                request.started = True
                status = message["status"]
            await send(message)

        request = Request(scope, path, receive, tracked)
        try:
            await self._answer(request)
        finally:
            route = path if path in ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()

    async def _answer(self, request: Request) -> None:
        methods = ROUTES.get(request.path)
        try:
            if methods is None:
                raise APIError(404, f"no route for {request.path}")
            if request.method == "OPTIONS":
                await respond(request.send, 204, b"", headers=[(b"allow", allow(methods))])
                return
            keys = self.options.api_keys
            if (
                keys.enabled
                and requires_auth(request.method, request.path)
                and not keys.check(request.headers.get(b"authorization"))
            ):
                raise APIError(401, "invalid or missing API key")
            handler = methods.get(request.method)
            if handler is None:
                raise method_not_allowed(request.method, methods)
            await handler(self, request)
        except APIError as e:
            if request.started:  # mid-response: ending it abruptly is all that is left
                raise
            headers: Headers | None = None
            if e.status == 401:
                headers = UNAUTHORIZED_HEADERS
            elif e.status == 405 and methods is not None:
                headers = [(b"allow", allow(methods))]
            if request.body_left_unread:
                headers = [*(headers or ()), (b"connection", b"close")]
            await respond_error(request.send, e, headers)
        except ClientDisconnected:
            pass
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if not request.started:
                await respond_error(request.send, APIError(500, "internal server error"))

    # Routes

    async def generate(self, request: Request) -> None:
        """Prefill on one instance, decode on another, beside a watch for the client leaving."""
        original = _json_object(await request.read_body(self.options.max_body_size))
        failure: APIError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, request.receive, nursery.cancel_scope)
            try:
                await self._prefill_then_decode(request, original)
            except APIError as e:
                failure = e  # raised below, outside the nursery, as the plain error it is
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def models(self, request: Request) -> None:
        await self._relay(request, self.decode, "GET", self._headers(request))

    async def health(self, request: Request) -> None:
        """200 while at least one instance of each kind answers its own `/health` with 200."""
        healthy: dict[str, int] = {"prefill": 0, "decode": 0}

        async def probe(kind: str, url: str) -> None:
            with trio.move_on_after(self.options.health_timeout):
                try:
                    response = await self.client.get(f"{url}/health")
                except httpx.HTTPError:
                    return
                if response.status_code == 200:
                    healthy[kind] += 1

        async with trio.open_nursery() as nursery:
            for instances in (self.prefill, self.decode):
                for url in instances.urls:
                    nursery.start_soon(probe, instances.kind, url)
        missing = [
            f"no healthy {instances.kind} instance (of {len(instances.urls)})"
            for instances in (self.prefill, self.decode)
            if not healthy[instances.kind]
        ]
        if missing:
            raise APIError(503, "; ".join(missing))
        await respond(request.send, 200, b"", content_type=b"text/plain; charset=utf-8")

    async def metrics_endpoint(self, request: Request) -> None:
        body = generate_latest(self.metrics.registry)
        await respond(request.send, 200, body, content_type=CONTENT_TYPE_LATEST.encode())

    # The exchange with the instances

    async def _prefill_then_decode(self, request: Request, original: dict[str, Any]) -> None:
        headers = self._headers(request)
        body = encode_json(prefill_request(original, self.options.kv_secret))
        url, response = await self._open(self.prefill, "POST", request.path, headers, body)
        try:
            answer = await response.aread()
        except httpx.HTTPError as e:
            raise self._failed(self.prefill, url, e) from e
        finally:
            await response.aclose()
        if not response.is_success:
            await respond(
                request.send,
                response.status_code,
                answer,
                content_type=response.headers.get("content-type", "application/json").encode(),
            )
            return
        params = self._kv_transfer_params(url, answer)
        body = encode_json({**original, "kv_transfer_params": params})
        await self._relay(request, self.decode, "POST", headers, body)

    def _kv_transfer_params(self, url: str, answer: bytes) -> dict[str, Any] | None:
        """The prefill's `kv_transfer_params`; None (decode recomputes) when it gave none."""
        try:
            completion = msgspec.json.decode(answer)
        except (msgspec.DecodeError, RecursionError):
            completion = None
        if not isinstance(completion, dict):
            raise APIError(502, f"the prefill instance {url} answered with no JSON object")
        params = completion.get("kv_transfer_params")
        if isinstance(params, dict):
            return params
        if url not in self._not_producers:
            self._not_producers.add(url)
            log.warning(
                "prefill instance %s returned no kv_transfer_params: is it a KV producer? "
                "Its requests are decoded from scratch",
                url,
            )
        return None

    async def _relay(
        self,
        request: Request,
        instances: Instances,
        method: str,
        headers: Headers,
        body: bytes | None = None,
    ) -> None:
        """Send the request to the next instance of `instances` and relay its answer as it
        arrives. Raises `APIError` (502, 504) when the answer breaks off."""
        url, response = await self._open(
            instances, method, request.path, headers, body, request.query
        )
        try:
            relayed = [
                (name.encode(), response.headers[name].encode())
                for name in _RELAYED
                if name in response.headers
            ]
            await request.send(
                {"type": "http.response.start", "status": response.status_code, "headers": relayed}
            )
            async with aclosing(response.aiter_raw()) as chunks:
                async for chunk in chunks:
                    if not chunk:
                        continue
                    message = {"type": "http.response.body", "body": chunk, "more_body": True}
                    await request.send(message)
            await request.send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as e:
            raise self._failed(instances, url, e) from e
        finally:
            await response.aclose()

    async def _open(
        self,
        instances: Instances,
        method: str,
        path: str,
        headers: Headers,
        body: bytes | None = None,
        query: bytes = b"",
    ) -> tuple[str, httpx.Response]:
        """The first instance in turn that takes the connection, and its response, unread (the
        caller closes it).

        Raises `APIError`: 502 when every instance refuses the connection; 502 or 504 when the
        one that took it fails before its response headers.
        """
        refusals: list[str] = []
        for url in instances.in_turn():
            target = httpx.URL(url + path, query=query) if query else httpx.URL(url + path)
            upstream = self.client.build_request(method, target, headers=headers, content=body)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.metrics.upstream_failures.labels(instances.kind).inc()
                instances.refused(url, e)
                refusals.append(f"{url} ({describe(e)})")
                continue
            except httpx.HTTPError as e:
                raise self._failed(instances, url, e) from e
            instances.reached(url)
            return url, response
        raise APIError(502, f"no {instances.kind} instance reachable: {', '.join(refusals)}")

    def _failed(self, instances: Instances, url: str, error: httpx.HTTPError) -> APIError:
        self.metrics.upstream_failures.labels(instances.kind).inc()
        log.warning("%s instance %s failed: %s", instances.kind, url, describe(error))
        if isinstance(error, httpx.TimeoutException):
            return APIError(
                504, f"the {instances.kind} instance {url} timed out: {describe(error)}"
            )
        return APIError(502, f"the {instances.kind} instance {url} failed: {describe(error)}")

    def _headers(self, request: Request) -> Headers:
        """The headers toward an instance: JSON, uncompressed, with the backend key, or the
        client's own only when the operator said so (a key given to the proxy is not a key
        to every instance behind it)."""
        headers = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
        if self.options.backend_api_key:
            headers.append((b"authorization", f"Bearer {self.options.backend_api_key}".encode()))
        elif self.options.forward_client_key and (
            (authorization := request.headers.get(b"authorization")) is not None
        ):
            headers.append((b"authorization", authorization))
        return headers


ROUTES: dict[str, dict[str, Handler]] = {
    "/health": {"GET": Proxy.health},
    "/metrics": {"GET": Proxy.metrics_endpoint},
    "/v1/models": {"GET": Proxy.models},
    "/v1/chat/completions": {"POST": Proxy.generate},
    "/v1/completions": {"POST": Proxy.generate},
}


def prefill_request(original: dict[str, Any], secret: bytes) -> dict[str, Any]:
    """The copy of a request a prefill instance gets: one token, one choice, not streamed, and
    the KV kept for a remote decode, asked for under the deployment's seal. Every other field
    is as the client gave it."""
    params = seal_remote_decode(secret, PREFILL_KV_PARAMS)
    body = {**original, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    for name in ("max_completion_tokens", "n"):
        if name in body:
            body[name] = 1
    body.pop("stream_options", None)
    return body


async def serve_proxy(
    options: ProxyOptions,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM or cancellation; `task_status` gets the bound URLs.

    The first signal stops accepting connections and gives in-flight requests
    `options.graceful_timeout` seconds; a second one stops at once. Raises `OSError` when the
    address cannot be bound.
    """
    timeout = httpx.Timeout(options.timeout, connect=options.connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=_IDLE_CONNECTIONS)
    # trust_env=False: the instances are addressed directly, never through an HTTP(S)_PROXY.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        proxy = Proxy(options, client)
        await serve_asgi(
            proxy,
            host=options.host,
            port=options.port,
            graceful_timeout=options.graceful_timeout,
            announce=lambda url: log.info(
                "proxying the OpenAI API on %s/v1: prefill on %s, decode on %s",
                url,
                ", ".join(options.prefill),
                ", ".join(options.decode),
            ),
            task_status=task_status,
        )
    log.info("proxy stopped")


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise validation_error(e) from e
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    return value
