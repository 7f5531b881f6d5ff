"""The ASGI application: routing, authentication, CORS and the small endpoints.

No framework: `App.__call__` takes raw ASGI messages. The path a request is routed on is the
scope's path with the root path removed, and the authentication decision is taken on that same
string, so no handler under `/v1` is reachable through a path the key check did not see.
Generation endpoints live in `completions/`, the pooling ones (embeddings, scores, rerank) in
`pooling/`, the Responses API in `responses/`, what the app is started with in `settings.py`.

Routes are exact paths, or paths with one `{response_id}` segment (`[^/]+`, matched on the same
string as the key check); the segment reaches the handler as `scope["path_params"]`. The
administrative routes (`admin.py`) are in an app's table only when its settings enable them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import version

import msgspec
import trio

from triode.actors import Engine

from . import fleet_info
from .admin import ADMIN_ROUTES, weight_version
from .auth import UNAUTHORIZED_HEADERS, paths_without_key, requires_auth
from .completions.request_bodies import DetokenizeRequest, TokenizeRequest, decode_request
from .completions.response_bodies import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from .completions.serving import Serving
from .errors import APIError, check_engine_alive, validation_error
from .health import HealthProbe
from .http import (
    ClientDisconnected,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    respond,
    respond_error,
    respond_json,
)
from .metrics import Metrics
from .pooling.serving import POOLING_ROUTES, Pooling
from .responses.serving import Responses
from .routing import allow, lifespan, method_not_allowed, routed_path
from .settings import Settings

log = logging.getLogger(__name__)

Handler = Callable[["App", Request], Awaitable[None]]


class App:
    """The OpenAI-compatible HTTP API over one running `Engine`."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.metrics = Metrics(self.model_name)
        self.serving = Serving(engine, settings, self.metrics)
        self.loras = self.serving.loras
        self.responses = Responses(engine, settings, self.metrics, self.loras)
        self.pooling = Pooling(engine, settings, self.metrics, self.loras)
        self.draining = False
        self._health = HealthProbe(engine, settings.health_stall_timeout)
        self._open_paths = paths_without_key(metrics_require_key=settings.metrics_require_key)
        self._routes = {**ROUTES, **ADMIN_ROUTES} if settings.enable_admin_api else ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await lifespan(receive, send)
        # websocket: not served; returning without accepting makes the server refuse it

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = routed_path(scope)
        request = Request(scope, path, receive, send)
        cors = self._cors_headers(request)
        request.response_headers.extend(cors)
        send = request.send = _tracking(request, send)
        try:
            if request.method == "OPTIONS":
                await self._options(request, cors)
                return
            if self.settings.api_keys.enabled and requires_auth(
                request.method, path, self._open_paths
            ):
                authorization = request.headers.get(b"authorization")
                request.key_digest = self.settings.api_keys.match(authorization)
                if request.key_digest is None:
                    raise APIError(401, "invalid or missing API key")
            methods = match_route(scope, path, self._routes)
            if methods is None:
                raise APIError(404, f"no route for {path}")
            handler = methods.get(request.method)
            if handler is None:
                raise method_not_allowed(request.method, methods)
            await handler(self, request)
        except APIError as e:
            headers = UNAUTHORIZED_HEADERS if e.status == 401 else None
            if e.status == 405:
                headers = [(b"allow", allow(match_route(scope, path, self._routes) or {}))]
            if request.body_left_unread:
                headers = [*(headers or ()), (b"connection", b"close")]
            if request.started:  # mid-response: nothing better to do than to end it
                raise
            await respond_error(send, e, [*(headers or ()), *e.headers])
        except ClientDisconnected:
            pass
        except Exception:
            log.exception("%s %s failed", request.method, path)
            if not request.started:
                await respond_error(send, APIError(500, "internal server error"))

    async def _options(self, request: Request, cors: list[tuple[bytes, bytes]]) -> None:
        methods = match_route(request.scope, request.path, self._routes)
        if methods is None:
            raise APIError(404, f"no route for {request.path}")
        allowed = allow(methods)
        headers = [(b"allow", allowed)]
        if cors and b"access-control-request-method" in request.headers:
            headers += [
                (b"access-control-allow-methods", allowed),
                (
                    b"access-control-allow-headers",
                    request.headers.get(b"access-control-request-headers", b"*"),
                ),
                (b"access-control-max-age", b"600"),
            ]
        await respond(request.send, 204, b"", headers=headers)

    def _cors_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        origins = self.settings.allowed_origins
        origin = request.headers.get(b"origin")
        if not origins or origin is None:
            return []
        if "*" in origins:
            return [(b"access-control-allow-origin", b"*")]
        if origin.decode("latin-1") in origins:
            return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        return []

    # Small endpoints

    async def health(self, request: Request) -> None:
        check_engine_alive(self.engine)  # why it is not is in the log
        problem = await self._health.problem()
        if problem is not None:
            raise APIError(503, problem)
        await respond(request.send, 200, b"", content_type=b"text/plain; charset=utf-8")

    async def version(self, request: Request) -> None:
        await respond_json(request.send, {"version": version("triode")})

    async def models(self, request: Request) -> None:
        """Every served name, then each LoRA adapter under its own name (`parent`: the base
        model it adapts, as vLLM shows it; `root`: its directory)."""
        root = str(self.engine.model_dir)
        version = await weight_version(self.engine, self.serving.weight_version)
        self.serving.weight_version = version
        await self.loras.refresh_if_stale()
        max_model_len = self.engine.max_model_len
        cards = [
            ModelCard(id=name, root=root, max_model_len=max_model_len, weight_version=version)
            for name in self.settings.served_model_names
        ]
        cards += [
            ModelCard(
                id=adapter["name"],
                root=adapter["path"],
                parent=adapter.get("base_model_name") or self.model_name,
                max_model_len=max_model_len,
                weight_version=version,
            )
            for adapter in self.loras.adapters
        ]
        await respond_json(request.send, ModelList(data=cards))

    async def metrics_endpoint(self, request: Request) -> None:
        self.metrics.update_scheduler(*await fleet_info.scheduler_gauges(self))
        self.metrics.engine.restarts = self.engine.restarts
        body, content_type = self.metrics.render()
        await respond(request.send, 200, body, content_type=content_type)

    async def tokenize(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, TokenizeRequest, request)
        await self.loras.pick(req.model)  # an adapter tokenizes as its base model does
        intake = self.engine.intake
        try:
            if req.messages is not None:
                _, tokens = await intake.encode_chat(
                    msgspec.to_builtins(req.messages),
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    add_special_tokens=bool(req.add_special_tokens),
                    template_kwargs=req.chat_template_kwargs,
                )
            else:
                assert req.prompt is not None
                tokens = await intake.encode(
                    req.prompt, add_special_tokens=bool(req.add_special_tokens)
                )
        except ValueError as e:
            raise validation_error(e) from e
        strs = [intake.token_text(t) for t in tokens] if req.return_token_strs else None
        await respond_json(
            request.send,
            TokenizeResponse(
                count=len(tokens),
                max_model_len=self.engine.max_model_len,
                tokens=tokens,
                token_strs=strs,
            ),
        )

    async def detokenize(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, DetokenizeRequest, request)
        await self.loras.pick(req.model)
        self.serving.check_token_ids(prompt=req.tokens, prompt_field="tokens")
        text = await self.engine.intake.decode(req.tokens)
        await respond_json(request.send, DetokenizeResponse(prompt=text))

    async def chat(self, request: Request) -> None:
        await self.serving.chat(request)

    async def completions(self, request: Request) -> None:
        await self.serving.completions(request)

    async def render_chat(self, request: Request) -> None:
        await self.serving.render_chat(request)

    async def render_completions(self, request: Request) -> None:
        await self.serving.render_completions(request)

    async def create_response(self, request: Request) -> None:
        await self.responses.create(request)

    async def retrieve_response(self, request: Request) -> None:
        await self.responses.retrieve(request)

    async def delete_response(self, request: Request) -> None:
        await self.responses.delete(request)

    async def cancel_response(self, request: Request) -> None:
        await self.responses.cancel(request)


@contextlib.asynccontextmanager
async def open_app(engine: Engine, settings: Settings) -> AsyncIterator[App]:
    """The app, with what outlives single requests: the LoRA adapters the engine has loaded
    (listed here), the MCP tool servers (connected here) and the nursery that background
    responses run in. Leaving cancels the background responses still running."""
    app = App(engine, settings)
    await app.loras.refresh()
    async with trio.open_nursery() as nursery:
        await app.responses.start(nursery)
        try:
            yield app
        finally:
            nursery.cancel_scope.cancel()


def default_served_model_name(model: str | None) -> str:
    """The name the API answers to for `model` when none is given (`--served-model-name`): its
    directory's or file's name (a .gguf's without the suffix); the default model's for None."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


ROUTES: dict[str, dict[str, Handler]] = {
    "/health": {"GET": App.health},
    "/version": {"GET": App.version},
    "/metrics": {"GET": App.metrics_endpoint},
    "/v1/models": {"GET": App.models},
    "/v1/chat/completions": {"POST": App.chat},
    "/v1/completions": {"POST": App.completions},
    "/v1/chat/completions/render": {"POST": App.render_chat},
    "/v1/completions/render": {"POST": App.render_completions},
    "/tokenize": {"POST": App.tokenize},
    "/detokenize": {"POST": App.detokenize},
    "/v1/responses": {"POST": App.create_response},
    **POOLING_ROUTES,
    # what vllm-router asks of its workers
    "/get_load": {"GET": fleet_info.get_load},
    "/get_server_info": {"GET": fleet_info.get_server_info},
    "/kv_event_sources": {"GET": fleet_info.kv_event_sources},
}

# Routes with a path parameter, tried after the exact ones: (pattern, methods).
PATTERN_ROUTES: list[tuple[re.Pattern[str], dict[str, Handler]]] = [
    (
        re.compile(r"/v1/responses/(?P<response_id>[^/]+)"),
        {"GET": App.retrieve_response, "DELETE": App.delete_response},
    ),
    (re.compile(r"/v1/responses/(?P<response_id>[^/]+)/cancel"), {"POST": App.cancel_response}),
]


def match_route(
    scope: Scope, path: str, routes: dict[str, dict[str, Handler]] = ROUTES
) -> dict[str, Handler] | None:
    """The methods served at `path` (its exact `routes`, then the pattern routes), or None; a
    pattern's parameters go to `scope["path_params"]`."""
    methods = routes.get(path)
    if methods is not None:
        return methods
    for pattern, methods in PATTERN_ROUTES:
        match = pattern.fullmatch(path)
        if match is not None:
            scope["path_params"] = match.groupdict()
            return methods
    return None


def _tracking(request: Request, send: Send) -> Send:
    """`send` that notes when the response has started and adds the request's
    `response_headers` to it."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            request.started = True
            if extra := request.response_headers:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return wrapped
