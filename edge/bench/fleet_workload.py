"""`triode bench fleet`'s workload: multi-turn chats whose users share a system prompt by group,
each user's turns sent in order with its earlier questions and answers, and one streamed
`POST /v1/chat/completions` as the client sees it (`stream_chat`)."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio

from ..sse import SSEParser
from .completion_stream import RequestResult
from .serve import WORDS


@dataclass(frozen=True)
class Conversation:
    """One user's chat: its group's system prompt and its questions, one per turn."""

    user: int
    group: int
    system: str
    questions: tuple[str, ...]


@dataclass
class ChatResult(RequestResult):
    """One turn as the client saw it: `RequestResult`'s timings (`latency` is the end-to-end
    time), the HTTP status (0 where none came), and the answer's text."""

    user: int = -1
    turn: int = -1
    status: int = 0
    text: str = ""


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high))).capitalize()


def system_prompt(group: int, tokens: int, seed: int) -> str:
    """About `tokens` tokens of varied sentences, the same for the same group and seed.

    It opens with the group's number, so that the prompts of two groups differ from their
    first KV block on; `WORDS` are a token each, and so is each full stop."""
    rng = random.Random(f"{seed}/system/{group}")
    sentences = [f"Team {group} assistant."]
    count = 4
    while count < tokens:
        sentence = _sentence(rng, 6, 14)
        sentences.append(sentence + ".")
        count += sentence.count(" ") + 2
    return " ".join(sentences)


def question(user: int, turn: int, seed: int) -> str:
    """User `user`'s message at `turn`: about 20 tokens, its own."""
    rng = random.Random(f"{seed}/user/{user}/{turn}")
    return f"User {user}, question {turn + 1}: {_sentence(rng, 12, 20)}?"


def build_conversations(
    users: int, turns: int, group_size: int, system_tokens: int, seed: int
) -> list[Conversation]:
    """`users` chats of `turns` questions; users `g * group_size` to `(g + 1) * group_size - 1`
    share group `g`'s system prompt."""
    systems: dict[int, str] = {}
    conversations = []
    for user in range(users):
        group = user // group_size
        if group not in systems:
            systems[group] = system_prompt(group, system_tokens, seed)
        asked = tuple(question(user, turn, seed) for turn in range(turns))
        conversations.append(Conversation(user, group, systems[group], asked))
    return conversations


def messages_for(
    conversation: Conversation, turn: int, answers: Sequence[str]
) -> list[dict[str, str]]:
    """The chat of `turn`: the system prompt, every earlier question with its answer, and
    this turn's question."""
    messages = [{"role": "system", "content": conversation.system}]
    for asked, answer in zip(conversation.questions[:turn], answers[:turn], strict=True):
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conversation.questions[turn]})
    return messages


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> ChatResult:
    """`POST {url}/v1/chat/completions` with `body` (which asks for a stream with usage), timed.

    TTFT is up to the first chunk with a token or the end: the opening chunk that carries only
    the assistant's role does not count, as a server may send it before the prompt's prefill.
    Any failure, including a stream without `[DONE]` or usage, is returned, never raised.
    Cancelling it closes the connection.
    """
    result = ChatResult()
    start = time.perf_counter()
    parser, text, done = SSEParser(), [], False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                error = (await response.aread()).decode(errors="replace")
                return _failed(result, f"HTTP {response.status_code}: {error[:500]}")
            async with aclosing(response.aiter_bytes()) as data:
                async for received in data:
                    for payload in parser.feed(received):
                        if payload == b"[DONE]":
                            done = True
                            continue
                        chunk = _decode_chunk(payload)
                        if chunk.error is not None:
                            return _failed(result, f"error event: {json.dumps(chunk.error)[:500]}")
                        tokens = [c for c in chunk.choices if c.delta.role is None]
                        if tokens and math.isnan(result.ttft):
                            result.ttft = time.perf_counter() - start
                        text += [c.delta.content or "" for c in chunk.choices]
                        if chunk.usage is not None:
                            result.prompt_tokens = chunk.usage.prompt_tokens
                            result.output_tokens = chunk.usage.completion_tokens
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        return _failed(result, f"{type(e).__name__}: {e}")
    result.latency, result.text = time.perf_counter() - start, "".join(text)
    if not done:
        return _failed(result, "the stream ended without [DONE]")
    if result.output_tokens == 0 or math.isnan(result.ttft):
        return _failed(result, "the stream carried no completion tokens")
    result.ok = True
    return result


def _failed(result: ChatResult, error: str) -> ChatResult:
    result.error = error
    return result


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A greedy, streamed chat request of exactly `max_tokens` tokens, with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_user(
    client: httpx.AsyncClient,
    urls: Iterator[str],
    conversation: Conversation,
    *,
    model: str,
    max_tokens: int,
    results: list[ChatResult],
) -> None:
    """`conversation`'s turns in order, each to the next of `urls`, appended to `results`; a
    failed turn ends the conversation (the next turns would lack its answer)."""
    answers: list[str] = []
    for turn in range(len(conversation.questions)):
        body = chat_body(model, messages_for(conversation, turn, answers), max_tokens)
        result = await stream_chat(client, next(urls), body)
        result.user, result.turn = conversation.user, turn
        results.append(result)
        if not result.ok:
            return
        answers.append(result.text)


async def run_workload(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    conversations: Sequence[Conversation],
    *,
    model: str,
    max_tokens: int,
    concurrency: int,
    arrival_interval: float = 0.0,
) -> tuple[list[ChatResult], float]:
    """Every conversation, at most `concurrency` users at a time, user i arriving
    `i * arrival_interval` seconds after the first; their requests go to `urls` in turn,
    request by request. The results in the order they ended, and the time taken. Cancelling it
    abandons the requests in flight."""
    limiter = trio.CapacityLimiter(concurrency)
    turn = itertools.cycle(urls)
    results: list[ChatResult] = []

    async def user(index: int, conversation: Conversation) -> None:
        await trio.sleep(index * arrival_interval)
        async with limiter:
            await run_user(
                client, turn, conversation, model=model, max_tokens=max_tokens, results=results
            )

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index, conversation in enumerate(conversations):
            nursery.start_soon(user, index, conversation)
    return results, time.perf_counter() - start


WARM_UP = Conversation(-1, -1, "Warm-up.", ("Hello?",))


async def warm_up(client: httpx.AsyncClient, urls: Sequence[str], model: str, times: int) -> None:
    """`times` short requests to `urls` in turn, not measured: the first request's costs (an
    instance's first step, the router's connections). Raises `RuntimeError` if one fails."""
    turn, body = itertools.cycle(urls), chat_body(model, messages_for(WARM_UP, 0, []), 2)
    for _ in range(times):
        result = await stream_chat(client, next(turn), body)
        if not result.ok:
            raise RuntimeError(f"a warm-up request failed: {result.error}")


async def probe(
    client: httpx.AsyncClient, router: str, urls: Sequence[str], model: str, pairs: int = 50
) -> tuple[float, float]:
    """TTFT medians in milliseconds of `pairs` one-token requests through `router` and as many
    straight to `urls` in turn, one at a time and alternating, on an otherwise idle fleet: what
    the router adds, without a loaded run's queueing noise. Raises `RuntimeError` if one
    fails."""
    body = chat_body(model, messages_for(WARM_UP, 0, []), 1)
    direct = itertools.cycle(urls)
    ttfts: tuple[list[float], list[float]] = ([], [])
    for pair in range(pairs):
        legs = [(router, ttfts[0]), (next(direct), ttfts[1])]
        for url, times in legs[:: 1 if pair % 2 else -1]:
            result = await stream_chat(client, url, body)
            if not result.ok:
                raise RuntimeError(f"a probe request failed: {result.error}")
            times.append(result.ttft)
    return statistics.median(ttfts[0]) * 1e3, statistics.median(ttfts[1]) * 1e3
