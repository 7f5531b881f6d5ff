"""One streamed `POST /v1/completions` as a client sees it: `stream_completion` times its
events into a `RequestResult` (time to first token, inter-token latencies, end-to-end latency,
the final usage's token counts)."""

from __future__ import annotations

import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from ..sse import SSEParser


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from sending it."""

    ok: bool = False
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def stream_completion(
    client: httpx.AsyncClient, body: dict[str, Any], *, counted: bool = False
) -> RequestResult:
    """`POST /v1/completions` with `body` (which asks for a stream with usage), timed.

    TTFT is up to the first chunk with a choice; each later one adds one ITL per token
    it carries (one unless the server sends usage with every chunk); the token counts are the
    final usage chunk's, or with `counted` (a server whose stream carries no usage) the chunks
    before the one that finishes. Any failure, including a stream without tokens or `[DONE]`,
    is returned as an error, never raised.
    """
    timer = _StreamTimer()
    parser = SSEParser()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return timer.fail(f"HTTP {response.status_code}: {text[:500]}")
            async with aclosing(response.aiter_bytes()) as data:
                async for received in data:
                    for payload in parser.feed(received):
                        timer.take(payload)
                    if timer.result.error:
                        return timer.result
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        return timer.fail(f"{type(e).__name__}: {e}")
    if counted:
        timer.result.output_tokens = timer.chunk_tokens
    return timer.finish()


class _StreamTimer:
    """Times one stream's events into a `RequestResult`."""

    def __init__(self) -> None:
        self.result = RequestResult()
        self.start = self.last = time.perf_counter()
        self.tokens_at_last: int | None = None  # completion tokens as of the last text, if known
        self.chunk_tokens = 0  # choices that did not finish: a token each
        self.done = False

    def take(self, payload: bytes) -> None:
        """One event's data; raises `msgspec.DecodeError` if it is not a completion chunk."""
        now = time.perf_counter()
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = _decode_chunk(payload)
        if chunk.error is not None:
            self.fail(f"error event: {json.dumps(chunk.error)[:500]}")
            return
        result, usage = self.result, chunk.usage
        self.chunk_tokens += sum(c.finish_reason is None for c in chunk.choices)
        if chunk.choices:  # a chunk carries new tokens (their text may be empty) or the end
            if math.isnan(result.ttft):
                result.ttft = now - self.start
            else:
                n = 1
                if usage is not None and self.tokens_at_last is not None:
                    n = max(1, usage.completion_tokens - self.tokens_at_last)
                result.itl.extend([(now - self.last) / n] * n)
            self.last = now
            self.tokens_at_last = None if usage is None else usage.completion_tokens
        if usage is not None:
            result.prompt_tokens = usage.prompt_tokens
            result.output_tokens = usage.completion_tokens

    def fail(self, error: str) -> RequestResult:
        self.result.error = error
        return self.result

    def finish(self) -> RequestResult:
        self.result.latency = time.perf_counter() - self.start
        if not self.done:
            return self.fail("the stream ended without [DONE]")
        if self.result.output_tokens == 0:
            return self.fail("the stream carried no completion tokens")
        self.result.ok = True
        return self.result
