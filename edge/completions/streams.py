"""The SSE streams of chat and completions answers.

A stream sends each delta as an SSE chunk as soon as it exists; a slow reader only makes the
next delta bigger (outputs coalesce in the request's stream, never in an unbounded queue here).
A formatter turns each delta output into the chunks of its response type. Every chunk carries
the version of the weights that made the latest tokens (`weight_version`); with
`return_token_ids`, each choice's chunk carries its delta's token ids, and a choice's first chunk
the prompt's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from triode.actors import RequestOutput
from triode.wire import SamplingParams

from ..errors import APIError, error_body
from ..http import Request, encode_json
from ..sse import DONE, KEEPALIVE, SSE_HEADERS, event
from ..tools.calls import ContentDelta, ToolCallStream
from .chat_tools import ChatTools
from .generation import Generation, Prompt, prompt_token_ids, usage_of
from .logprobs import chat_logprobs, completion_logprobs
from .request_bodies import ChatCompletionRequest, CompletionRequest
from .response_bodies import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)


async def stream(
    generation: Generation,
    request: Request,
    prompts: list[Prompt],
    params: SamplingParams,
    request_id: str,
    formatter: StreamFormatter,
    kv_transfer_params: dict[str, Any] | None = None,
    stop_when: Callable[[int, RequestOutput], bool] | None = None,
) -> None:
    """Answer `request` with an SSE stream of its prompts' generations
    (`Generation.generate`): each delta as the chunks `formatter` makes of it, then `[DONE]`.
    An `APIError` raised before the first chunk is raised on (its own status answers it); one
    raised after it ends the stream as an error event."""
    send = request.send
    started = False

    # The status goes out with the first chunk (the first output, or a keep-alive), so that
    # a request the engine refuses at once still gets its own status (429, 400), not a 200.
    async def write(chunks: Sequence[bytes]) -> None:
        nonlocal started
        if not started:
            started = True
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            chunks = [*formatter.opening(), *chunks]
        if chunks:
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

    async def on_output(index: int, out: RequestOutput) -> None:
        await write(formatter.chunks(index, out))

    async def keep_alive() -> None:
        await write([KEEPALIVE])

    try:
        await generation.generate(
            request, prompts, params, request_id, on_output, kv_transfer_params, stop_when,
            keep_alive,
        )  # fmt: skip
    except APIError as e:
        if not started:
            raise
        await write([*formatter.aborted(), event(error_body(e))])
    else:
        await write(formatter.closing())
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


class StreamFormatter:
    """Turns a request's delta outputs into SSE chunks of one response type (`envelope`)."""

    envelope: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse]

    def __init__(
        self,
        serving: Generation,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
    ) -> None:
        self.serving = serving
        self.model = req.model or serving.model_name  # the name asked for: served or an adapter's
        self.id = request_id
        self.created = int(time.time())
        self.prompts = prompts
        self.n = req.n or 1
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(
            options and options.continuous_usage_stats
        )
        self.token_ids = bool(req.return_token_ids)
        self.as_ids = bool(req.return_tokens_as_token_ids)
        # the latest output's; until one came, the engine's as last seen
        self.weight_version = serving.weight_version

    def _chunk(self, choices: list[Any], usage: UsageInfo | None = None, **extra: Any) -> bytes:
        response = self.envelope(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            weight_version=self.weight_version,
            **extra,
        )
        return event(encode_json(response))

    def _running_usage(self) -> UsageInfo | None:
        return usage_of(self.prompts) if self.continuous_usage else None

    def opening(self) -> list[bytes]:
        return []

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        raise NotImplementedError

    def closing(self) -> list[bytes]:
        return [self._chunk([], usage_of(self.prompts))] if self.include_usage else []

    def aborted(self) -> list[bytes]:
        """After a failure mid-stream (the engine core died under it): a last chunk with
        finish_reason "abort" for each choice that had not finished."""
        return [
            self._chunk([self._ended(i * self.n + c, "abort")])
            for i, prompt in enumerate(self.prompts)
            for c, choice in enumerate(prompt.choices)
            if choice.finish_reason is None
        ]

    def _ended(self, index: int, finish_reason: str) -> Any:
        """An empty choice that says it ended, and why."""
        raise NotImplementedError


class ChatStream(StreamFormatter):
    envelope = ChatCompletionStreamResponse

    def __init__(
        self,
        serving: Generation,
        req: ChatCompletionRequest,
        request_id: str,
        prompt: Prompt,
        tools: ChatTools | None = None,
    ) -> None:
        super().__init__(serving, req, request_id, [prompt])
        self.req = req
        self.tools = tools
        # per choice: the tool-call parser of its text, and whether it made a call
        calls = tools is not None and tools.calls
        self.parsers = [ToolCallStream(tools.tools) for _ in range(self.n)] if calls else []
        self.called = [False] * self.n

    def _ended(self, index: int, finish_reason: str) -> Any:
        return ChatCompletionResponseStreamChoice(
            index=index, delta=DeltaMessage(content=""), finish_reason=finish_reason
        )

    def ended(self, index: int, out: RequestOutput) -> bool:
        """Whether every choice has ended on a repeated call (the generation can stop)."""
        return all(p.ended for p in self.parsers)

    def opening(self) -> list[bytes]:
        first = [
            ChatCompletionResponseStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content="")
            )
            for i in range(self.n)
        ]
        ids = prompt_token_ids(self.req, self.prompts[0])
        return [self._chunk([choice], prompt_token_ids=ids) for choice in first]

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        self.weight_version = out.weight_version
        result = []
        usage = self._running_usage()
        top = self.req.top_logprobs or 0
        for c in out.outputs:
            if not (c.text or c.token_ids or c.finish_reason):
                continue
            delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
            if self.parsers:
                if self.parsers[c.index].ended:  # a repeated call ended it: the rest is dropped
                    continue
                delta, finish_reason = self._tool_delta(c.index, c.text, c.finish_reason)
            choice = ChatCompletionResponseStreamChoice(
                index=c.index,
                delta=delta,
                logprobs=chat_logprobs(self.serving.engine, c.logprobs, top, as_ids=self.as_ids),
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if self.token_ids else None,
            )
            result.append(self._chunk([choice], usage))
        return result

    def _tool_delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[DeltaMessage, str | None]:
        """The delta of a choice whose text may hold tool calls: content outside them, and
        each call's id and name first, then its arguments."""
        parser = self.parsers[index]
        events = parser.feed(text) if text else []
        if finish_reason is not None:
            events += parser.finish()
        delta = DeltaMessage(content="")
        content = []
        for e in events:
            if isinstance(e, ContentDelta):
                content.append(e.text)
                continue
            self.called[index] = True
            delta.tool_calls.append(
                DeltaToolCall(
                    index=e.index,
                    id=e.id,
                    type="function" if e.id is not None else None,
                    function=DeltaFunctionCall(name=e.name, arguments=e.arguments),
                )
            )
        delta.content = "".join(content) if content or not delta.tool_calls else None
        if parser.ended:
            finish_reason = "stop"
        if finish_reason == "stop" and self.called[index]:
            finish_reason = "tool_calls"
        return delta, finish_reason


class CompletionStream(StreamFormatter):
    envelope = CompletionStreamResponse

    def __init__(
        self,
        serving: Generation,
        req: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
    ) -> None:
        super().__init__(serving, req, request_id, prompts)
        self.req = req
        # per (prompt, choice): the text offset so far, for logprobs' text_offset
        self.offsets: dict[tuple[int, int], int] = {}

    def _ended(self, index: int, finish_reason: str) -> Any:
        return CompletionResponseStreamChoice(index=index, text="", finish_reason=finish_reason)

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        self.weight_version = out.weight_version
        prompt = self.prompts[index]
        usage = self._running_usage()
        result = []
        for c in out.outputs:
            key = (index, c.index)
            first = key not in self.offsets
            echo = bool(first and self.req.echo and prompt.text)
            if not (c.text or c.token_ids or c.finish_reason or echo):
                continue
            offset = self.offsets.get(key, 0)
            text = (prompt.text or "") + c.text if echo else c.text
            logprobs = completion_logprobs(
                self.serving.engine,
                prompt,
                c,
                self.req,
                echo=echo,
                logprobs=c.logprobs,
                offset=offset,
            )
            self.offsets[key] = offset + len(text)
            choice = CompletionResponseStreamChoice(
                index=index * self.n + c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=prompt_token_ids(self.req, prompt) if first else None,
                token_ids=c.token_ids if self.token_ids else None,
            )
            result.append(self._chunk([choice], usage))
        return result
