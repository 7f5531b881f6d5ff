"""The Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel` and `DELETE /v1/responses/{id}`.

A request is checked whole before anything is answered (`plan_response`), so every bad input is
a 400. Then the tool loop runs (`tool_loop.py`): generate, call MCP tools, generate again,
until the model answers or calls a function tool; `ResponseBuilder` turns all of it into output
items and, for a stream, typed SSE events.

Foreground requests run beside a task that watches for `http.disconnect`: a disconnect cancels
the run, and `Engine.generate` aborts the request in the engine. Background requests run in the
app's nursery under a cancel scope that `cancel` cancels, to the same effect.
"""

from __future__ import annotations

import logging
import math
from urllib.parse import parse_qs

import trio

from triode.actors import Engine

from ..errors import APIError, check_engine_alive, too_busy
from ..http import JSON, ClientDisconnected, Request, respond, respond_json
from ..lora_names import LoraNames
from ..metrics import Metrics
from ..settings import Settings
from ..sse import KEEPALIVE, SSE_HEADERS
from ..tenancy import request_cache_salt
from ..tools.mcp import ToolServers
from .events import encode
from .output import ResponseBuilder
from .plan import Plan, plan_response
from .request import decode_responses_request
from .response import ResponseError
from .store import ResponseStore, StoredResponse
from .tool_loop import Flush, ToolLoop, keep_text

log = logging.getLogger(__name__)

_CANCEL_WAIT = 10.0  # seconds `cancel` waits for the run to stop before answering


class Responses:
    """The Responses API over one engine: its handlers, its store and its tool servers."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: Metrics,
        loras: LoraNames,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.loras = loras
        self.model_name = settings.served_model_names[0]
        self.store = ResponseStore(
            settings.max_stored_responses,
            ttl=settings.response_ttl,
            max_bytes=settings.max_stored_response_bytes,
        )
        self._background_count = 0  # queued or running
        self.tool_servers = ToolServers(
            settings.tool_servers,
            call_timeout=settings.tool_call_timeout,
            allow_request_servers=settings.allow_request_tool_servers,
            allow_private_servers=settings.allow_private_tool_servers,
        )
        self.loop = ToolLoop(engine, metrics, self.tool_servers)
        self._tasks: trio.Nursery | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        """Connect the configured tool servers; background responses run in `nursery` from
        then on. A checkpoint; cancelled, background responses stay unavailable."""
        await self.tool_servers.start()
        self._tasks = nursery

    # Handlers

    async def create(self, request: Request) -> None:
        """`POST /v1/responses`. Raises a 4xx `APIError` for a bad request (before anything
        is sent), a 503 one for a dead engine, and `ClientDisconnected` when the client of a
        foreground response leaves (its run is cancelled and its engine request aborted)."""
        body = await request.read_body(self.settings.max_body_size)
        req = decode_responses_request(body, request)
        lora_name = await self.loras.pick(req.model)
        check_engine_alive(self.engine)
        if req.background:
            self._check_background_room()  # before the work of planning
        owner = self._owner(request)
        plan = await plan_response(
            req, engine=self.engine, store=self.store, tool_servers=self.tool_servers,
            model_name=self.model_name, max_tool_turns=self.settings.max_tool_turns,
            owner=owner,
        )  # fmt: skip
        isolation = self.settings.prefix_cache_isolation
        plan.cache_salt = request_cache_salt(isolation, request.key_digest, req.cache_salt)
        plan.lora_name = lora_name
        if req.background:
            await self._background(request, plan, owner)
            return
        entry = StoredResponse(plan.response, owner=owner)
        if plan.response.store:
            self.store.add(entry)
        if req.stream:
            await self._stream(request, plan, entry)
            return
        out = ResponseBuilder(plan.response, streaming=False, mcp_tools=plan.mcp_tools())
        failure = await self._foreground(request, plan, out, entry, _nothing)
        if failure is not None:
            raise failure
        await respond_json(request.send, plan.response)

    async def retrieve(self, request: Request) -> None:
        """`GET /v1/responses/{id}`: the stored response as it stands (404 if unknown)."""
        query = parse_qs(request.query.decode("latin-1"))
        if query.get("stream", ["false"])[-1].lower() == "true":
            raise APIError(400, "stream: streaming a stored response is not supported",
                           param="stream")  # fmt: skip
        entry = self._stored(request)
        await respond_json(request.send, entry.response)

    async def cancel(self, request: Request) -> None:
        """`POST /v1/responses/{id}/cancel`: stop a background run and answer with its
        response once the run has ended (its engine request aborted); 400 for a foreground
        response. One that has already ended is returned as it is."""
        entry = self._stored(request)
        if entry.scope is None:
            raise APIError(400, "only a background response can be cancelled")
        entry.scope.cancel()
        with trio.move_on_after(_CANCEL_WAIT):
            await entry.done.wait()
        await respond_json(request.send, entry.response)

    async def delete(self, request: Request) -> None:
        """`DELETE /v1/responses/{id}`: forget it, and cancel it if it runs in the background."""
        entry = self._stored(request)
        self.store.pop(entry.response.id)
        if entry.scope is not None:
            entry.scope.cancel()
        body = {"id": entry.response.id, "object": "response.deleted", "deleted": True}
        await respond_json(request.send, body)

    def _owner(self, request: Request) -> bytes:
        """The caller's key digest (b"" on a server without keys: all callers are one)."""
        return self.settings.api_keys.match(request.headers.get(b"authorization")) or b""

    def _check_background_room(self) -> None:
        limit = self.settings.max_background_responses
        if self._background_count >= limit:
            raise too_busy(f"background: {limit} background responses are queued or running "
                           "already; try again when one has ended")  # fmt: skip

    def _stored(self, request: Request) -> StoredResponse:
        response_id = request.scope["path_params"]["response_id"]
        entry = self.store.get(response_id, self._owner(request))
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           type="invalid_request_error", param="response_id")  # fmt: skip
        return entry

    # Running one

    async def _foreground(
        self, request: Request, plan: Plan, out: ResponseBuilder, entry: StoredResponse,
        flush: Flush, keepalive: _Writer | None = None,
    ) -> APIError | None:  # fmt: skip
        """Run beside a disconnect watcher (and, for a stream, a keep-alive task); raises
        `ClientDisconnected` when the client left (the run is cancelled)."""
        failure: APIError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(request.cancel_on_disconnect, nursery.cancel_scope)
                if keepalive is not None:
                    nursery.start_soon(keepalive.keep_alive, self.settings.keepalive_interval)
                failure = await self.loop.run(plan, out, flush)
                nursery.cancel_scope.cancel()
        except Exception:
            out.finish("failed", error=ResponseError(code="server_error",
                                                     message="internal server error"))  # fmt: skip
            raise
        finally:
            keep_text(plan, out.finish("cancelled"))
            entry.conversation = plan.conversation
            self.store.ended(entry)
            entry.done.set()
        if request.disconnected:
            raise ClientDisconnected
        return failure

    async def _stream(self, request: Request, plan: Plan, entry: StoredResponse) -> None:
        out = ResponseBuilder(plan.response, streaming=True, mcp_tools=plan.mcp_tools())
        await request.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = _Writer(request)

        async def flush() -> None:
            await writer.write(out.take())

        await self._foreground(request, plan, out, entry, flush, writer)
        await writer.write(out.take())
        await request.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _background(self, request: Request, plan: Plan, owner: bytes) -> None:
        if self._tasks is None:
            raise APIError(503, "background responses are not available in this server")
        self._check_background_room()  # others may have started while this one was planned
        response = plan.response
        response.status = "queued"
        entry = StoredResponse(response, scope=trio.CancelScope(), owner=owner)
        self._background_count += 1
        self.store.add(entry)
        streaming = bool(plan.req.stream)
        out = ResponseBuilder(response, streaming=streaming, mcp_tools=plan.mcp_tools())
        if not streaming:
            queued = encode(response)
            self._tasks.start_soon(self._run_background, plan, out, entry, None)
            await respond(request.send, 200, queued, content_type=JSON)
            return
        send, receive = trio.open_memory_channel[bytes](math.inf)
        self._tasks.start_soon(self._run_background, plan, out, entry, send)
        await request.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = _Writer(request)
        # following the run: leaving (disconnect) stops the following, not the run
        async with receive, trio.open_nursery() as nursery:
            nursery.start_soon(request.cancel_on_disconnect, nursery.cancel_scope)
            nursery.start_soon(writer.keep_alive, self.settings.keepalive_interval)
            async for frames in receive:
                await writer.write([frames])
            nursery.cancel_scope.cancel()
        await request.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _run_background(
        self,
        plan: Plan,
        out: ResponseBuilder,
        entry: StoredResponse,
        channel: trio.MemorySendChannel[bytes] | None,
    ) -> None:
        def push() -> None:
            nonlocal channel
            frames = out.take()
            if channel is not None and frames:
                try:
                    channel.send_nowait(b"".join(frames))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    channel = None  # the follower left; the run goes on

        async def flush() -> None:
            push()

        assert entry.scope is not None
        try:
            with entry.scope:
                await self.loop.run(plan, out, flush)
        except Exception:
            log.exception("background response %s failed", plan.response.id)
            out.finish("failed", error=ResponseError(code="server_error",
                                                     message="internal server error"))  # fmt: skip
        finally:
            keep_text(plan, out.finish("cancelled"))
            entry.conversation = plan.conversation
            push()
            if channel is not None:
                channel.close()
            self._background_count -= 1
            self.store.ended(entry)
            entry.done.set()


class _Writer:
    """An SSE response's body: frames as they come, and keep-alive comments when idle."""

    def __init__(self, request: Request) -> None:
        self._send = request.send
        self._lock = trio.Lock()
        self._last = trio.current_time()

    async def write(self, frames: list[bytes]) -> None:
        if not frames:
            return
        async with self._lock:
            await self._send(
                {"type": "http.response.body", "body": b"".join(frames), "more_body": True}
            )
            self._last = trio.current_time()

    async def keep_alive(self, interval: float) -> None:
        while True:
            await trio.sleep_until(self._last + interval)
            if trio.current_time() >= self._last + interval:
                await self.write([KEEPALIVE])


async def _nothing() -> None:
    pass
