"""Running a chat or completions request's prompts on the engine, and the caps on what one
request may ask for.

Each of a request's prompts runs as one `Engine.generate` in delta mode, all in one nursery
beside a task that watches for `http.disconnect`. A disconnect cancels the nursery; each
generation's `finally` aborts its request in the engine from a shielded, time-bounded scope, so
the KV blocks come back whether the client was streaming or waiting for a whole answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import trio

from triode.actors import (
    CompletionOutput,
    Engine,
    EngineDeadError,
    RequestError,
    RequestOutput,
    TokenLogprob,
    out_of_vocabulary,
)
from triode.wire import SamplingParams

from ..errors import APIError, engine_error, validation_error
from ..http import ClientDisconnected, Request
from ..lora_names import LoraNames
from ..metrics import Metrics
from ..settings import Settings
from .request_bodies import ChatCompletionRequest, CompletionRequest
from .response_bodies import PromptTokenUsageInfo, UsageInfo


@dataclass
class Prompt:
    """One prompt of a request and what its generation has produced so far."""

    token_ids: list[int]  # placeholders for a prompt given as embeddings
    text: str | None
    choices: list[CompletionOutput] = field(default_factory=list)
    embeds: Any = None  # the prompt as embeddings: a torch tensor [positions, hidden size]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # what its KV blocks are hashed with (edge/tenancy.py)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    weight_version: int = 0  # of the weights that made its latest tokens
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
        self.weight_version = out.weight_version
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
            if delta.finish_reason is not None:  # told once, in the delta that ends it
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


def usage_of(prompts: list[Prompt]) -> UsageInfo:
    """The token counts of an answer over all its prompts, as its `usage` reports them."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(p.num_generated for p in prompts)
    cached = sum(p.num_cached_tokens for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached) if cached else None,
    )


def prompt_token_ids(
    req: ChatCompletionRequest | CompletionRequest, prompt: Prompt
) -> list[int] | None:
    """The prompt's ids for an answer whose request asks for them (`return_token_ids`); None
    otherwise, and for a prompt given as embeddings, which has none."""
    if not req.return_token_ids or prompt.embeds is not None:
        return None
    return prompt.token_ids


def weight_version_of(prompts: list[Prompt]) -> int:
    """The version of the weights that made an answer's latest tokens."""
    return max(p.weight_version for p in prompts)


class Generation:
    """What the chat and completions handlers share: the engine they run on, the caps on what
    one request may ask for, and running a request's prompts to their ends."""

    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.model_name = settings.served_model_names[0]
        # the names a request's `model` may give: the served ones and the adapters'
        self.loras = LoraNames(engine, settings.served_model_names)
        # the engine's weight version as last seen (an output's, or the engine's answer)
        self.weight_version = 0

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
        prompts: list[Prompt],
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

    async def generate(
        self,
        request: Request,
        prompts: list[Prompt],
        params: SamplingParams,
        request_id: str,
        on_output: Callable[[int, RequestOutput], Awaitable[None]] | None,
        kv_transfer_params: dict[str, Any] | None = None,
        stop_when: Callable[[int, RequestOutput], bool] | None = None,
        keep_alive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Run every prompt's generation to its end (or the client's disconnect), folding each
        delta into its `Prompt` and then calling `on_output(prompt index, delta)`, then
        `stop_when(prompt index, delta)`: a prompt for which that turns true before its end is
        aborted there, and its unfinished choices end with "stop". `keep_alive` is called
        whenever nothing came for the keep-alive interval.

        Raises `ClientDisconnected`, or an `APIError` for a refused request (400), a full
        queue (429) or a dead engine (503).
        """
        rank = data_parallel_rank(request)
        send_channel, receive_channel = trio.open_memory_channel[
            tuple[int, RequestOutput] | BaseException
        ](0)
        failure: BaseException | None = None
        scopes = [trio.CancelScope() for _ in prompts]

        async def produce(index: int, prompt: Prompt, channel: trio.MemorySendChannel) -> None:  # type: ignore[type-arg]
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
                        lora_name=prompt.lora_name,
                        data_parallel_rank=rank,
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
                    self.weight_version = max(self.weight_version, out.weight_version)
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

    def _observe(self, prompt: Prompt) -> None:
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


def data_parallel_rank(request: Request) -> int | None:
    """The engine core an `X-data-parallel-rank` header asks for (vLLM's: vllm-router sends it
    to an instance with several), or None; a 400 when it is not a small non-negative integer."""
    value = request.headers.get(b"x-data-parallel-rank")
    if value is None:
        return None
    if not (value.isdigit() and len(value) <= 4):
        raise APIError(400, "X-data-parallel-rank: must be an engine core's index (0, 1, ...)")
    return int(value)
