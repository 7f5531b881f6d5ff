"""The generation endpoints: `/v1/chat/completions` and `/v1/completions`.

A request is validated, templated and tokenized (the intake), then each of its prompts runs as
one `Engine.generate` in delta mode, all in one nursery beside a task that watches for
`http.disconnect`. A disconnect cancels the nursery; each generation's `finally` aborts its
request in the engine from a shielded, time-bounded scope, so the KV blocks come back whether
the client was streaming or waiting for a whole answer. Streams send each delta as an SSE chunk
as soon as it exists; a slow reader only makes the next delta bigger (outputs coalesce in the
request's stream, never in an unbounded queue here).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from triode.actors import CompletionOutput, Engine, EngineDeadError, RequestError, RequestOutput
from triode.actors.core.kv_connector import transfer_params_error
from triode.actors.outputs import TokenLogprob
from triode.actors.vocabulary import out_of_vocabulary
from triode.wire import SamplingParams, StructuredOutputsParams

from ..errors import APIError, check_engine_alive, engine_error, error_body, validation_error
from ..http import ClientDisconnected, Request, encode_json, respond_json
from ..metrics import Metrics
from ..settings import Settings
from ..sse import DONE, KEEPALIVE, SSE_HEADERS, event
from ..tenancy import request_cache_salt
from ..tools.calls import (
    ContentDelta,
    ToolCallReader,
    ToolCallStream,
    call_grammar,
)
from ..tools.choice import (
    FunctionTool,
    ToolChoice,
    check_tool_messages,
    parse_tool_choice,
    parse_tools,
    prepare_messages,
    template_renders_tools,
)
from .prompt_embeds import decode_prompt_embeds
from .protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    PromptTokenUsageInfo,
    ToolCallOut,
    UsageInfo,
    decode_request,
    sampling_params,
)
from .structured import check_structured, structured_from_grammar, structured_outputs_of

# Logprobs of -inf do not survive JSON; clamp them like vLLM does.
_MIN_LOGPROB = -9999.0


@dataclass
class _Prompt:
    """One prompt of a request and what its generation has produced so far."""

    token_ids: list[int]  # placeholders for a prompt given as embeddings
    text: str | None
    choices: list[CompletionOutput] = field(default_factory=list)
    embeds: Any = None  # the prompt as embeddings: a torch tensor [positions, hidden size]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # what its KV blocks are hashed with (edge/tenancy.py)
    # timing, for the metrics
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)
    # each choice's text in the pieces it came in, until `join_text`: appending each delta to
    # one string would copy the whole text every step
    pieces: list[list[str]] = field(default_factory=list)

    def take(self, out: RequestOutput) -> None:
        """Fold a delta output into the cumulative state (the text: `join_text`)."""
        if not self.choices:
            self.choices = [
                CompletionOutput(c.index, logprobs=None if c.logprobs is None else [])
                for c in out.outputs
            ]
            self.pieces = [[] for _ in out.outputs]
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.prompt_logprobs:
            self.prompt_logprobs += out.prompt_logprobs
        new_tokens = 0
        for mine, pieces, delta in zip(self.choices, self.pieces, out.outputs, strict=True):
            if delta.text:
                pieces.append(delta.text)
            mine.token_ids += delta.token_ids
            new_tokens += len(delta.token_ids)
            if delta.logprobs is not None and mine.logprobs is not None:
                mine.logprobs += delta.logprobs
            mine.finish_reason, mine.stop_reason = delta.finish_reason, delta.stop_reason
        if new_tokens:
            now = time.perf_counter()
            if self.first_token is None:
                self.first_token = now
            elif self.last_token is not None:
                self.inter_token.append((now - self.last_token) / new_tokens)
            self.last_token = now

    def join_text(self) -> None:
        """Give each choice its whole text."""
        for mine, pieces in zip(self.choices, self.pieces, strict=True):
            mine.text = "".join(pieces)

    @property
    def num_generated(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class Serving:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.model_name = settings.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise APIError(
                404, f"the model {name!r} does not exist", param="model", code="model_not_found"
            )

    def check_token_ids(self, **fields: Any) -> None:
        """A 400 naming the field for a token id the model has no row for (`out_of_vocabulary`'s
        fields): refused here, so that such a request never reaches the engine."""
        problem = out_of_vocabulary(self.engine.vocab_size, **fields)
        if problem is not None:
            raise validation_error(ValueError(problem))

    def check_choices(
        self, req: ChatCompletionRequest | CompletionRequest, num_prompts: int
    ) -> None:
        """A 400 for a request of more generations (prompts x n) than the server takes in one
        (`Settings.max_choices_per_request`)."""
        limit, n = self.settings.max_choices_per_request, req.n or 1
        if num_prompts * n > limit:
            param = "n" if n > 1 else "prompt"
            raise APIError(
                400,
                f"{param}: {num_prompts} prompts x n = {n} ask for {num_prompts * n} choices; "
                f"this server takes at most {limit} in one request",
                param=param,
            )

    def check_logprobs_volume(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
    ) -> None:
        """A 400 for a whole (not streamed) answer that could hold more logprob entries
        (positions x (1 + alternatives)) than `Settings.max_logprob_entries`: it is built in
        memory before it is sent. A stream sends them as they come, so it has no such bound."""
        if req.stream:
            return
        entries, param = 0, "prompt_logprobs"
        if params.logprobs is not None:
            assert params.max_tokens is not None  # `sampling_params` always sets it
            entries = len(prompts) * params.n * params.max_tokens * (1 + params.logprobs)
            param = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        if params.prompt_logprobs is not None:
            positions = sum(len(p.token_ids) for p in prompts)
            entries += positions * (1 + params.prompt_logprobs)
        limit = self.settings.max_logprob_entries
        if entries > limit:
            raise APIError(
                400,
                f"{param}: the answer could hold {entries} logprob entries (positions x (1 + "
                f"alternatives), for every choice); at most {limit} are built for a whole "
                "answer: lower max_tokens, n or the alternatives asked for, or stream it",
                param=param,
            )

    # Chat

    async def chat(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, ChatCompletionRequest)
        self.check_model(req.model)
        check_engine_alive(self.engine)
        self.check_choices(req, 1)
        messages = msgspec.to_builtins(req.messages)
        tools = _ChatTools.of(req, messages)
        template_kwargs = req.chat_template_kwargs
        structured = await _structured(req)
        if tools is not None:
            template = self.engine.intake.chat_template
            renders = template is not None and template_renders_tools(template.source)
            messages, extra = tools.prepare(messages, renders_tools=renders)
            template_kwargs = {**extra, **(template_kwargs or {})}
            if tools.grammar is not None:
                if structured is not None:
                    raise APIError(
                        400,
                        "tool_choice: a required or named tool choice cannot be combined with "
                        "a structured output constraint",
                        param="tool_choice",
                    )
                structured = structured_from_grammar(tools.grammar)
        try:
            _, token_ids = await self.engine.intake.encode_chat(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens,
                template_kwargs=template_kwargs,
            )
        except ValueError as e:
            raise validation_error(e) from e
        params = sampling_params(
            req,
            prompt_len=len(token_ids),
            max_model_len=self.engine.max_model_len,
            structured_outputs=structured,
        )
        self.check_token_ids(params=params)
        prompts = [_Prompt(token_ids, None)]
        self.check_logprobs_volume(req, prompts, params)
        self._salt(request, req.cache_salt, prompts)
        _check_transfer_params(req.kv_transfer_params, prompts, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            chat_stream = _ChatStream(self, req, request_id, prompts[0], tools)
            await self._stream(
                request, prompts, params, request_id, chat_stream, req.kv_transfer_params,
                stop_when=chat_stream.ended if chat_stream.parsers else None,
            )  # fmt: skip
            return
        readers = None if tools is None or not tools.calls else _CallReaders(tools.tools, params.n)
        await self._generate(
            request, prompts, params, request_id, None, req.kv_transfer_params, stop_when=readers
        )
        prompt = prompts[0]
        choices = []
        for c in prompt.choices:
            message, finish_reason = ChatMessageOut(content=c.text), c.finish_reason
            if readers is not None:
                message, finish_reason = _tool_message(readers.of[c.index], c.finish_reason)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(c.logprobs, req.top_logprobs or 0),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=_usage(prompts),
            kv_transfer_params=prompt.kv_transfer_params,
        )
        await respond_json(request.send, response)

    def _chat_logprobs(
        self, logprobs: list[TokenLogprob] | None, top: int
    ) -> ChatCompletionLogProbs | None:
        if logprobs is None:
            return None
        text = self.engine.intake.token_text
        content = []
        for lp in logprobs:
            token = text(lp.token_id)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(lp.logprob, _MIN_LOGPROB),
                    bytes=list(token.encode()),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=text(t),
                            logprob=max(v, _MIN_LOGPROB),
                            bytes=list(text(t).encode()),
                        )
                        for t, v in lp.top[:top]
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    # Completions

    async def completions(self, request: Request) -> None:
        body = await request.read_body(self.settings.max_body_size)
        req = decode_request(body, CompletionRequest)
        self.check_model(req.model)
        check_engine_alive(self.engine)
        # before any prompt costs a decode or a tokenization
        self.check_choices(req, len(req.embeds_prompts()) + len(req.prompts()))
        intake = self.engine.intake
        prompts = await self._embeds_prompts(req)
        for p in req.prompts():
            if isinstance(p, str):
                ids = await intake.encode(p, add_special_tokens=req.add_special_tokens)
                prompts.append(_Prompt(ids, p))
            else:
                self.check_token_ids(prompt=p, prompt_field="prompt")
                prompts.append(_Prompt(list(p), None))
        if any(not p.token_ids for p in prompts):
            raise APIError(400, "prompt: must not be empty", param="prompt")
        longest = max(prompts, key=lambda p: len(p.token_ids))
        params = sampling_params(
            req,
            prompt_len=len(longest.token_ids),
            max_model_len=self.engine.max_model_len,
            structured_outputs=await _structured(req),
        )
        self.check_token_ids(params=params)
        self.check_logprobs_volume(req, prompts, params)
        _check_transfer_params(req.kv_transfer_params, prompts, params)
        self._salt(request, req.cache_salt, prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.echo:
            for p in prompts:
                if p.text is None:
                    p.text = await intake.decode(p.token_ids, skip_special_tokens=False)
        if req.stream:
            completion_stream = _CompletionStream(self, req, request_id, prompts)
            await self._stream(
                request, prompts, params, request_id, completion_stream, req.kv_transfer_params
            )
            return
        await self._generate(request, prompts, params, request_id, None, req.kv_transfer_params)
        choices = []
        for i, prompt in enumerate(prompts):
            for c in prompt.choices:
                echo = prompt.text if req.echo and prompt.text else ""
                choices.append(
                    CompletionResponseChoice(
                        index=i * params.n + c.index,
                        text=echo + c.text,
                        logprobs=self._completion_logprobs(prompt, c, req, echo=bool(echo)),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        response = CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=_usage(prompts),
            kv_transfer_params=prompts[0].kv_transfer_params,
        )
        await respond_json(request.send, response)

    async def _embeds_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        """The prompts given as embeddings, decoded off the event loop. Raises a 400 for a
        payload that is not one, or for options that need the prompt's tokens."""
        payloads = req.embeds_prompts()
        if not payloads:
            return []
        for name, value in (
            ("echo", req.echo),
            ("prompt_logprobs", req.prompt_logprobs is not None),
            ("kv_transfer_params", req.kv_transfer_params),
        ):
            if value:
                raise APIError(400, f"{name}: not supported with prompt_embeds", param=name)
        decode = functools.partial(
            decode_prompt_embeds,
            hidden_size=self.engine.hidden_size,
            max_model_len=self.engine.max_model_len,
            max_bytes=self.settings.max_body_size,
        )
        # each choice gets its own copy in shared memory: n copies count n times
        copies, budget = req.n or 1, self.settings.max_prompt_embeds_bytes
        prompts, total = [], 0
        for payload in payloads:
            embeds = await trio.to_thread.run_sync(decode, payload)
            total += embeds.nbytes * copies
            if total > budget:
                raise APIError(
                    400,
                    f"prompt_embeds: {total} bytes or more once decoded, counted once per "
                    f"choice; this server takes at most {budget} in one request",
                    param="prompt_embeds",
                )
            prompts.append(_Prompt([0] * len(embeds), None, embeds=embeds))
        return prompts

    def _completion_logprobs(
        self,
        prompt: _Prompt,
        choice: CompletionOutput,
        req: CompletionRequest,
        *,
        echo: bool,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
    ) -> CompletionLogProbs | None:
        if req.logprobs is None:
            return None
        entries: list[tuple[int, TokenLogprob | None]] = []
        if echo:
            first = prompt.token_ids[0]
            entries.append((first, None))
            entries += [(lp.token_id, lp) for lp in prompt.prompt_logprobs]
        source = choice.logprobs if logprobs is None else logprobs
        entries += [(lp.token_id, lp) for lp in source or ()]
        text = self.engine.intake.token_text
        out = CompletionLogProbs()
        for token_id, lp in entries:
            token = text(token_id)
            out.text_offset.append(offset)
            offset += len(token)
            out.tokens.append(token)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(lp.logprob, _MIN_LOGPROB))
            top = {text(t): max(v, _MIN_LOGPROB) for t, v in lp.top[: req.logprobs]}
            top.setdefault(token, max(lp.logprob, _MIN_LOGPROB))
            out.top_logprobs.append(top)
        return out

    # Driving the engine

    def _salt(self, request: Request, cache_salt: str | None, prompts: list[_Prompt]) -> None:
        """Give the prompts the salt their KV blocks are hashed with: the request's own
        `cache_salt`, and the caller's key under `--prefix-cache-isolation key`."""
        isolation = self.settings.prefix_cache_isolation
        salt = request_cache_salt(isolation, request.key_digest, cache_salt)
        for prompt in prompts:
            prompt.cache_salt = salt

    async def _generate(
        self,
        request: Request,
        prompts: list[_Prompt],
        params: SamplingParams,
        request_id: str,
        on_output: Callable[[int, RequestOutput], Awaitable[None]] | None,
        kv_transfer_params: dict[str, Any] | None = None,
        stop_when: Callable[[int, RequestOutput], bool] | None = None,
        keep_alive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Run every prompt's generation to its end (or the client's disconnect), folding each
        delta into its `_Prompt` and then calling `on_output(prompt index, delta)`, then
        `stop_when(prompt index, delta)`: a prompt for which that turns true before its end is
        aborted there, and its unfinished choices end with "stop". `keep_alive` is called
        whenever nothing came for the keep-alive interval.

        Raises `ClientDisconnected`, or an `APIError` for a refused request (400), a full
        queue (429) or a dead engine (503).
        """
        send_channel, receive_channel = trio.open_memory_channel[
            tuple[int, RequestOutput] | BaseException
        ](0)
        failure: BaseException | None = None
        scopes = [trio.CancelScope() for _ in prompts]

        async def produce(index: int, prompt: _Prompt, channel: trio.MemorySendChannel) -> None:  # type: ignore[type-arg]
            rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            async with channel:
                try:
                    generation = self.engine.generate(
                        prompt.token_ids if prompt.embeds is None else None,
                        params,
                        rid,
                        delta=True,
                        kv_transfer_params=kv_transfer_params,
                        prompt_embeds=prompt.embeds,
                        cache_salt=prompt.cache_salt,
                    )
                    with scopes[index]:
                        async with aclosing(generation) as outputs:
                            async for out in outputs:
                                await channel.send((index, out))
                except (RequestError, EngineDeadError, RuntimeError) as e:
                    await channel.send(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request.cancel_on_disconnect, nursery.cancel_scope)
            async with send_channel:
                for i, prompt in enumerate(prompts):
                    nursery.start_soon(produce, i, prompt, send_channel.clone())
            async with receive_channel:
                while True:
                    with trio.move_on_after(self.settings.keepalive_interval) as idle:
                        try:
                            item = await receive_channel.receive()
                        except trio.EndOfChannel:
                            break
                    if idle.cancelled_caught:
                        if keep_alive is not None:
                            await keep_alive()
                        continue
                    if isinstance(item, BaseException):
                        failure = item
                        break
                    index, out = item
                    prompt = prompts[index]
                    prompt.take(out)
                    if out.finished:
                        self._observe(prompt)
                    if on_output is not None:
                        await on_output(index, out)
                    if stop_when is not None and stop_when(index, out) and not out.finished:
                        scopes[index].cancel()
                        for c in prompt.choices:
                            c.finish_reason = c.finish_reason or "stop"
                        self._observe(prompt)
            nursery.cancel_scope.cancel()
        for prompt in prompts:
            prompt.join_text()
        if request.disconnected:
            raise ClientDisconnected
        if failure is not None:
            raise engine_error(failure)

    def _observe(self, prompt: _Prompt) -> None:
        now = time.perf_counter()
        ttft = None if prompt.first_token is None else prompt.first_token - prompt.start
        reasons = {c.finish_reason for c in prompt.choices}
        self.metrics.observe_request(
            prompt_tokens=len(prompt.token_ids),
            generation_tokens=prompt.num_generated,
            ttft=ttft,
            inter_token_latencies=prompt.inter_token,
            e2e=now - prompt.start,
            finished_reason=next(iter(reasons)) if len(reasons) == 1 else "stop",
        )

    async def _stream(
        self,
        request: Request,
        prompts: list[_Prompt],
        params: SamplingParams,
        request_id: str,
        formatter: _StreamFormatter,
        kv_transfer_params: dict[str, Any] | None = None,
        stop_when: Callable[[int, RequestOutput], bool] | None = None,
    ) -> None:
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
                await send(
                    {"type": "http.response.body", "body": b"".join(chunks), "more_body": True}
                )

        async def on_output(index: int, out: RequestOutput) -> None:
            await write(formatter.chunks(index, out))

        async def keep_alive() -> None:
            await write([KEEPALIVE])

        try:
            await self._generate(
                request, prompts, params, request_id, on_output, kv_transfer_params, stop_when,
                keep_alive,
            )  # fmt: skip
        except APIError as e:
            if not started:
                raise
            await write([event(error_body(e))])
        else:
            await write(formatter.closing())
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


class _StreamFormatter:
    """Turns a request's delta outputs into SSE chunks of one response type (`envelope`)."""

    envelope: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse]

    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
    ) -> None:
        self.serving = serving
        self.id = request_id
        self.created = int(time.time())
        self.prompts = prompts
        self.n = req.n or 1
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(
            options and options.continuous_usage_stats
        )

    def _chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> bytes:
        response = self.envelope(
            id=self.id,
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
            usage=usage,
        )
        return event(encode_json(response))

    def _running_usage(self) -> UsageInfo | None:
        return _usage(self.prompts) if self.continuous_usage else None

    def opening(self) -> list[bytes]:
        return []

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        raise NotImplementedError

    def closing(self) -> list[bytes]:
        return [self._chunk([], _usage(self.prompts))] if self.include_usage else []


class _ChatStream(_StreamFormatter):
    envelope = ChatCompletionStreamResponse

    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest,
        request_id: str,
        prompt: _Prompt,
        tools: _ChatTools | None = None,
    ) -> None:
        super().__init__(serving, req, request_id, [prompt])
        self.req = req
        self.tools = tools
        # per choice: the tool-call parser of its text, and whether it made a call
        calls = tools is not None and tools.calls
        self.parsers = [ToolCallStream(tools.tools) for _ in range(self.n)] if calls else []
        self.called = [False] * self.n

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
        return [self._chunk([choice]) for choice in first]

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
        result = []
        usage = self._running_usage()
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
                logprobs=self.serving._chat_logprobs(c.logprobs, self.req.top_logprobs or 0),
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
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


class _CompletionStream(_StreamFormatter):
    envelope = CompletionStreamResponse

    def __init__(
        self,
        serving: Serving,
        req: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
    ) -> None:
        super().__init__(serving, req, request_id, prompts)
        self.req = req
        # per (prompt, choice): the text offset so far, for logprobs' text_offset
        self.offsets: dict[tuple[int, int], int] = {}

    def chunks(self, index: int, out: RequestOutput) -> list[bytes]:
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
            logprobs = self.serving._completion_logprobs(
                prompt, c, self.req, echo=echo, logprobs=c.logprobs, offset=offset
            )
            self.offsets[key] = offset + len(text)
            choice = CompletionResponseStreamChoice(
                index=index * self.n + c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            result.append(self._chunk([choice], usage))
        return result


def _usage(prompts: list[_Prompt]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(p.num_generated for p in prompts)
    cached = sum(p.num_cached_tokens for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached) if cached else None,
    )


@dataclass
class _ChatTools:
    """A chat request's tools: how its prompt describes them and how its output is read."""

    tools: list[FunctionTool]
    choice: ToolChoice
    grammar: str | None  # forcing a call, for a required or named choice

    @classmethod
    def of(cls, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> _ChatTools | None:
        """None for a request with neither tools nor tool messages: nothing changes for it."""
        check_tool_messages(messages)
        history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if req.tools is None and req.tool_choice is None and not history:
            return None
        tools = parse_tools(req.tools) if req.tools is not None else []
        choice = parse_tool_choice(req.tool_choice, tools)
        parallel = req.parallel_tool_calls is not False
        return cls(tools, choice, call_grammar(tools, choice, parallel=parallel))

    def prepare(
        self, messages: list[dict[str, Any]], *, renders_tools: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prepare_messages(messages, self.tools, self.choice, renders_tools=renders_tools)

    @property
    def calls(self) -> bool:
        """Whether the answer may call tools."""
        return bool(self.tools) and self.choice.mode != "none"


class _CallReaders:
    """Each choice's calls, read as a whole (not streamed) chat answer comes, so that its
    generation stops once every choice has repeated a call (which ends an answer: see
    `edge/tool_calls.py`). Called with every delta, as `stop_when`."""

    def __init__(self, tools: list[FunctionTool], n: int) -> None:
        self.of = [ToolCallReader(tools) for _ in range(n)]

    def __call__(self, index: int, out: RequestOutput) -> bool:
        for c in out.outputs:
            if c.text:
                self.of[c.index].feed(c.text)
        return all(reader.ended for reader in self.of)


def _tool_message(
    reader: ToolCallReader, finish_reason: str | None
) -> tuple[ChatMessageOut, str | None]:
    """The assistant message of a whole answer, its calls taken out of its text."""
    content, calls = reader.finish()
    message = ChatMessageOut(
        content=content or None,
        tool_calls=[
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls
        ],
    )
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return message, finish_reason


async def _structured(
    req: ChatCompletionRequest | CompletionRequest,
) -> StructuredOutputsParams | None:
    found = structured_outputs_of(req)
    if found is None:
        return None
    field, so = found
    await check_structured(so, param=field)
    return so


def _check_transfer_params(
    params: dict[str, Any] | None, prompts: list[_Prompt], sampling: SamplingParams
) -> None:
    """A 400 for `kv_transfer_params` of the wrong shape, or on a request that is not one
    generation (one prompt, n = 1): a transfer hands on one sequence's KV."""
    if not params:
        return
    problem = transfer_params_error(params)
    if problem is None and (len(prompts) != 1 or sampling.n != 1):
        problem = "kv_transfer_params: work with one prompt and n = 1 only"
    if problem is not None:
        raise APIError(400, problem, param="kv_transfer_params")
