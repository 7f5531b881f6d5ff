"""The tool loop of a Responses request: a checked request (`Plan`) run to its response's end.

Generate; hand calls to MCP tools to their servers and generate again with the results, up to
`max_tool_turns` rounds (the last generation has no tools, so it answers); a call to a function
tool ends the response, for the client to run. `ResponseBuilder` turns all of it into output
items and, for a stream, typed SSE events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from triode.actors import Engine, EngineDeadError, RequestError
from triode.wire import SamplingParams

from .. import json_text
from ..errors import APIError, engine_error, validation_error
from ..metrics import Metrics
from ..tools.calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
)
from ..tools.choice import ToolChoice
from ..tools.mcp import ToolServerError, ToolServers
from .output import ResponseBuilder, Turn
from .plan import Plan
from .response import FunctionCall, McpCall, ResponseError

log = logging.getLogger(__name__)

Flush = Callable[[], Awaitable[None]]

_AUTO = ToolChoice(mode="auto", name=None)


class ToolLoop:
    """Runs planned responses on one engine, calling MCP tools on `tool_servers`."""

    def __init__(self, engine: Engine, metrics: Metrics, tool_servers: ToolServers) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tool_servers = tool_servers

    async def run(self, plan: Plan, out: ResponseBuilder, flush: Flush) -> APIError | None:
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
            defaults = self.engine.generation_defaults  # what the request cannot give
            params = SamplingParams(
                temperature=plan.response.temperature,
                top_p=plan.response.top_p,
                top_k=max(0, defaults.get("top_k", 0)),
                min_p=defaults.get("min_p", 0.0),
                repetition_penalty=defaults.get("repetition_penalty", 1.0),
                seed=plan.req.seed,
                max_tokens=min(max_tokens, defaults.get("max_tokens") or max_tokens),
                structured_outputs=plan.constraint(turn_choice),
            )
            parser = None if turn_choice.mode == "none" else ToolCallStream(plan.tools)
            request_id = f"{plan.response.id}-{rounds}"
            try:
                reason, generated = await self._generate(
                    ids, params, request_id, out, parser, flush, plan.cache_salt, plan.lora_name
                )
            except (RequestError, EngineDeadError, RuntimeError) as e:
                return self._fail(out, engine_error(e))
            produced += generated
            ids = None
            if reason == "length":
                keep_text(plan, out.finish("incomplete", reason="max_output_tokens"))
                return None
            if reason == "abort":  # the engine let it go (a pause that aborts): not a failure
                keep_text(plan, out.finish("incomplete", reason="abort"))
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
        lora_name: str | None = None,
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
                ids, params, request_id, delta=True, cache_salt=cache_salt, lora_name=lora_name
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


def _route(out: ResponseBuilder, events: list[Any]) -> None:
    for event in events:
        if isinstance(event, ContentDelta):
            out.text(event.text)
        elif isinstance(event, ToolCallDelta):
            out.call(event.index, event.id, event.name, event.arguments or "")


def keep_text(plan: Plan, turn: Turn) -> None:
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
