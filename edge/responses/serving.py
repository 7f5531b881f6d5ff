"""The Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel` and `DELETE /v1/responses/{id}`.

A request is checked whole before anything is answered (`plan_response`), so every bad input is
a 400. Then the tool loop runs: generate; hand
calls to MCP tools to their servers and generate again with the results, up to
`max_tool_turns` rounds (the last generation has no tools, so it answers); a call to a function
tool ends the response, for the client to run. `ResponseBuilder` turns all of it into output
items and, for a stream, typed SSE events.

Foreground requests run beside a task that watches for `http.disconnect`: a disconnect cancels
the run, and `Engine.generate` aborts the request in the engine. Background requests run in the
app's nursery under a cancel scope that `cancel` cancels, to the same effect.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any
from urllib.parse import parse_qs

import trio

from triode.actors import Engine, EngineDeadError, RequestError
from triode.wire import SamplingParams

from .. import json_text
from ..errors import APIError, check_engine_alive, engine_error, too_busy, validation_error
from ..http import JSON, ClientDisconnected, Request, respond, respond_json
from ..metrics import Metrics
from ..settings import Settings
from ..sse import KEEPALIVE, SSE_HEADERS
from ..tenancy import request_cache_salt
from ..tools.calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
)
from ..tools.choice import ToolChoice
from ..tools.mcp import ToolServerError, ToolServers
from .output import ResponseBuilder, Turn
from .plan import Plan, plan_response
from .protocol import (
    FunctionCall,
    McpCall,
    ResponseError,
    decode_responses_request,
    encode,
)
from .store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

Flush = Callable[[], Awaitable[None]]

_AUTO = ToolChoice(mode="auto", name=None)
_CANCEL_WAIT = 10.0  # seconds `cancel` waits for the run to stop before answering


class Responses:
    """The Responses API over one engine: its handlers, its store and its tool servers."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        metrics: Metrics,
        check_model: Callable[[str | None], None],
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.check_model = check_model
        self.model_name = settings.served_model_names[0]
        self.store = ResponseStore(settings.max_stored_responses, ttl=settings.response_ttl)
        self._background_count = 0  # queued or running
        self.tool_servers = ToolServers(
            settings.tool_servers,
            call_timeout=settings.tool_call_timeout,
            allow_request_servers=settings.allow_request_tool_servers,
            allow_private_servers=settings.allow_private_tool_servers,
        )
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
        req = decode_responses_request(body)
        self.check_model(req.model)
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
                failure = await self._run(plan, out, flush)
                nursery.cancel_scope.cancel()
        except Exception:
            out.finish("failed", error=ResponseError(code="server_error",
                                                     message="internal server error"))  # fmt: skip
            raise
        finally:
            _keep_text(plan, out.finish("cancelled"))
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
                await self._run(plan, out, flush)
        except Exception:
            log.exception("background response %s failed", plan.response.id)
            out.finish("failed", error=ResponseError(code="server_error",
                                                     message="internal server error"))  # fmt: skip
        finally:
            _keep_text(plan, out.finish("cancelled"))
            entry.conversation = plan.conversation
            push()
            if channel is not None:
                channel.close()
            self._background_count -= 1
            self.store.ended(entry)
            entry.done.set()

    async def _run(self, plan: Plan, out: ResponseBuilder, flush: Flush) -> APIError | None:
        """The tool loop, to the response's end. Returns the error a failed response failed
        with (engine refused it or died); cancelling it leaves the response open."""
        out.start()
        for listing in plan.listings:
            out.list_tools(listing)
        await flush()
        choice, rounds, calls, produced = plan.choice, 0, 0, 0
        ids: list[int] | None = plan.first_ids
        while True:
            turn_choice = plan.turn_choice(choice, rounds=rounds, calls=calls)
            if ids is None:
                try:
                    ids = await plan.encode(self.engine.intake, turn_choice)
                except ValueError as e:
                    return self._fail(out, validation_error(e))
            max_tokens = self.engine.max_model_len - len(ids)
            if plan.req.max_output_tokens is not None:
                max_tokens = min(max_tokens, plan.req.max_output_tokens - produced)
            if max_tokens < 1:
                out.finish("incomplete", reason="max_output_tokens")
                return None
            params = SamplingParams(
                temperature=plan.response.temperature,
                top_p=plan.response.top_p,
                seed=plan.req.seed,
                max_tokens=max_tokens,
                structured_outputs=plan.constraint(turn_choice),
            )
            parser = None if turn_choice.mode == "none" else ToolCallStream(plan.tools)
            request_id = f"{plan.response.id}-{rounds}"
            try:
                reason, generated = await self._generate(
                    ids, params, request_id, out, parser, flush, plan.cache_salt
                )
            except (RequestError, EngineDeadError, RuntimeError) as e:
                return self._fail(out, engine_error(e))
            produced += generated
            ids = None
            if reason == "length":
                _keep_text(plan, out.finish("incomplete", reason="max_output_tokens"))
                return None
            if reason != "stop":
                return self._fail(out, APIError(500, f"generation ended with {reason}"))
            turn = out.end_turn()
            await flush()
            plan.conversation.append(_assistant_message(plan, turn))
            mcp_calls = [c for c in turn.calls if isinstance(c, McpCall)]
            for call in mcp_calls:
                output, error = await self._call_mcp(plan, call)
                out.mcp_result(call, output, error)
                result = output if error is None else f"error: {error}"
                plan.conversation.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result or ""}
                )
                await flush()
            calls += len(mcp_calls)
            if not mcp_calls or any(isinstance(c, FunctionCall) for c in turn.calls):
                out.finish("completed")
                return None
            rounds += 1
            if choice.mode in ("required", "named"):
                choice = _AUTO  # forcing a call again would never let the model answer

    def _fail(self, out: ResponseBuilder, error: APIError) -> APIError:
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        out.finish("failed", error=ResponseError(code=code, message=error.message))
        return error

    async def _generate(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        out: ResponseBuilder,
        parser: ToolCallStream | None,
        flush: Flush,
        cache_salt: str | None = None,
    ) -> tuple[str | None, int]:
        """One generation, fed to `out` delta by delta: (finish reason, tokens generated)."""
        start = time.perf_counter()
        first: float | None = None
        last: float | None = None
        inter: list[float] = []
        reason: str | None = None
        generated = cached = 0
        try:
            generation = self.engine.generate(
                ids, params, request_id, delta=True, cache_salt=cache_salt
            )
            async with aclosing(generation) as outputs:
                async for output in outputs:
                    choice = output.outputs[0]
                    cached = output.num_cached_tokens
                    if choice.token_ids:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        elif last is not None:
                            inter.append((now - last) / len(choice.token_ids))
                        last = now
                        generated += len(choice.token_ids)
                    if parser is None:
                        out.text(choice.text)
                    else:
                        _route(out, parser.feed(choice.text))
                    reason = choice.finish_reason or reason
                    await flush()
                    if parser is not None and parser.ended:
                        reason = "stop"  # a repeated call ends the turn: stop generating
                        break
            if parser is not None:
                _route(out, parser.finish())
        finally:
            usage = out.response.usage
            assert usage is not None  # every plan's response starts with one
            usage.add(input_tokens=len(ids), output_tokens=generated, cached_tokens=cached)
        self.metrics.observe_request(
            prompt_tokens=len(ids),
            generation_tokens=generated,
            ttft=None if first is None else first - start,
            inter_token_latencies=inter,
            e2e=time.perf_counter() - start,
            finished_reason=reason or "abort",
        )
        return reason, generated

    async def _call_mcp(self, plan: Plan, call: McpCall) -> tuple[str | None, str | None]:
        """(output, error) of one MCP tool call; failures of every kind become the error."""
        server_url = plan.server_url(call.server_label, call.name)
        try:
            arguments = json_text.loads(call.arguments or "{}")
        except ValueError as e:
            return None, f"the arguments are not valid JSON: {e}"
        if not isinstance(arguments, dict):
            return None, "the arguments must be a JSON object"
        try:
            result = await self.tool_servers.call(
                call.server_label, call.name, arguments, server_url=server_url
            )
        except Exception as e:  # a failing tool must not fail the response
            log.warning("MCP call %s/%s failed", call.server_label, call.name, exc_info=True)
            if isinstance(e, ToolServerError):  # a refusal, in this server's own words
                return None, str(e)
            return None, "the tool call failed (the server log has why)"
        return result.output, result.error


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


def _route(out: ResponseBuilder, events: list[Any]) -> None:
    for event in events:
        if isinstance(event, ContentDelta):
            out.text(event.text)
        elif isinstance(event, ToolCallDelta):
            out.call(event.index, event.id, event.name, event.arguments or "")


def _keep_text(plan: Plan, turn: Turn) -> None:
    """Keep the text of a generation cut short in the conversation (its calls are unfinished)."""
    if turn.text:
        plan.conversation.append({"role": "assistant", "content": turn.text})


def _assistant_message(plan: Plan, turn: Turn) -> dict[str, Any]:
    """The chat message for what the model said in `turn`, with its calls as `tool_calls`."""
    if not turn.calls:
        return {"role": "assistant", "content": turn.text}
    calls = []
    for c in turn.calls:
        if isinstance(c, FunctionCall):
            call_id, name = c.call_id, c.name
        else:
            call_id, name = c.id, plan.mcp_name(c.server_label, c.name)
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": name, "arguments": c.arguments}})  # fmt: skip
    return {"role": "assistant", "content": turn.text or None, "tool_calls": calls}
