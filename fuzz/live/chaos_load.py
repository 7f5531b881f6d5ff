"""The chaos harness's clients: a mix of what users send (chat and completions, streamed and
not, n > 1, structured output, tools, `/v1/responses` with and without `store`, requests that
name a LoRA adapter, clients that go away mid-answer), each ending in exactly one `Outcome`.

A request ends as an answer (`ok`: every choice finished once, a stream closed by `[DONE]`),
as one clear error (`error`: an HTTP status with the OpenAI error shape, or a stream's error
event), as the client's own leaving (`left`), or as `lost` (the connection dropped, which
only a killed API server may cause). Anything else is `bad`, with what was wrong: a stream
that stops without `[DONE]` on a live connection, a choice that finishes twice or never, a
body that is neither an answer nor an error. Whether an error or a loss was allowed then is
the ledger's question (`chaos_checks.py`): only around a kill.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from triode.edge.sse import SSEParser

# the longest any request may take before it counts as never ending
REQUEST_TIMEOUT = 120.0
PROMPTS = (
    "The capital of France is",
    "Write a haiku about rivers.",
    "List three prime numbers:",
    "Once upon a time",
    "def fibonacci(n):",
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass
class Outcome:
    """How one request ended."""

    action: str
    started: float  # time.monotonic()
    ended: float
    result: str  # "ok", "error", "left", "lost" or "bad"
    status: int | None = None  # the HTTP status, None where none came
    detail: str = ""


class Load:
    """One client's requests against the server at `url`; `model` is the served name and
    `adapter` the LoRA adapter's name while it is loaded (requests may name it)."""

    def __init__(self, client: httpx.AsyncClient, model: str, rng: random.Random) -> None:
        self.client = client
        self.model = model
        self.adapter: str | None = None
        self.rng = rng

    def actions(self) -> list[str]:
        return [
            "completion", "completion_stream", "chat", "chat_stream", "structured", "tools",
            "responses", "stream_left", "request_left",
        ]  # fmt: skip

    async def one(self) -> Outcome:
        """One request of a kind drawn at random, to its end."""
        action = self.rng.choice(self.actions())
        started = time.monotonic()
        try:
            result, status, detail = await getattr(self, "_" + action)()
        except httpx.TimeoutException as e:
            result, status, detail = "bad", None, f"no end within {REQUEST_TIMEOUT:g} s: {e!r}"
        except (httpx.TransportError, httpx.StreamError) as e:
            result, status, detail = "lost", None, repr(e)
        return Outcome(action, started, time.monotonic(), result, status, detail)

    # the requests

    def _model(self) -> str:
        if self.adapter is not None and self.rng.random() < 0.3:
            return self.adapter
        return self.model

    def _sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.rng.randint(2, 40),
            "temperature": self.rng.choice([0.0, 0.7, 1.0]),
            "n": self.rng.choice([1, 1, 1, 2]),
        }

    def _messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.rng.choice(PROMPTS)}]

    async def _completion(self) -> tuple[str, int | None, str]:
        body = {"model": self._model(), "prompt": self.rng.choice(PROMPTS), **self._sampling()}
        return _whole(await self.client.post("/v1/completions", json=body), body["n"])

    async def _chat(self) -> tuple[str, int | None, str]:
        body = {"model": self._model(), "messages": self._messages(), **self._sampling()}
        return _whole(await self.client.post("/v1/chat/completions", json=body), body["n"])

    async def _structured(self) -> tuple[str, int | None, str]:
        body = {
            "model": self._model(),
            "messages": self._messages(),
            "max_tokens": 48,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": SCHEMA},
            },
        }
        return _whole(await self.client.post("/v1/chat/completions", json=body), 1)

    async def _tools(self) -> tuple[str, int | None, str]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS,
            "tool_choice": self.rng.choice(["auto", "required", "none"]),
            "max_tokens": 32,
        }
        return _whole(await self.client.post("/v1/chat/completions", json=body), 1)

    async def _responses(self) -> tuple[str, int | None, str]:
        store = self.rng.random() < 0.5
        body = {
            "model": self.model,
            "input": self.rng.choice(PROMPTS),
            "max_output_tokens": self.rng.randint(4, 32),
            "store": store,
        }
        response = await self.client.post("/v1/responses", json=body)
        if response.status_code != 200:
            return _error(response)
        answer = response.json()
        if answer.get("status") not in ("completed", "incomplete", "cancelled"):
            return "bad", 200, f"a response that did not end: {answer.get('status')!r}"
        if store:  # kept by the API server that answered (another may not have it: 404)
            kept = await self.client.get(f"/v1/responses/{answer['id']}")
            if kept.status_code not in (200, 404):
                return _error(kept)
        return "ok", 200, ""

    async def _completion_stream(self) -> tuple[str, int | None, str]:
        body = {"model": self._model(), "prompt": self.rng.choice(PROMPTS), **self._sampling()}
        return await self._stream("/v1/completions", body)

    async def _chat_stream(self) -> tuple[str, int | None, str]:
        body = {"model": self._model(), "messages": self._messages(), **self._sampling()}
        return await self._stream("/v1/chat/completions", body)

    async def _stream(self, path: str, body: dict[str, Any]) -> tuple[str, int | None, str]:
        body = {**body, "stream": True}
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _error(response)
            parser = SSEParser()
            events: list[bytes] = []
            async for chunk in response.aiter_bytes():
                events += parser.feed(chunk)
        return _streamed(events, body["n"])

    async def _stream_left(self) -> tuple[str, int | None, str]:
        """A streamed request whose client leaves after the first chunk."""
        body = {"model": self._model(), "prompt": self.rng.choice(PROMPTS), "max_tokens": 64,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _error(response)
            async for _ in response.aiter_bytes():
                break
        return "left", 200, ""

    async def _request_left(self) -> tuple[str, int | None, str]:
        """A whole-answer request whose client gives up before the answer."""
        body = {"model": self._model(), "prompt": self.rng.choice(PROMPTS), "max_tokens": 200,
                "ignore_eos": True}  # fmt: skip
        try:
            response = await self.client.post(
                "/v1/completions", json=body, timeout=self.rng.uniform(0.05, 0.5)
            )
        except httpx.TimeoutException:
            return "left", None, ""
        return _whole(response, 1)


def _error(response: httpx.Response) -> tuple[str, int | None, str]:
    """An error status: `error` with the OpenAI shape, else `bad`."""
    try:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return "bad", response.status_code, f"an error without the OpenAI shape: {response.text!r}"
    return "error", response.status_code, error["message"][:200]


def _whole(response: httpx.Response, n: int) -> tuple[str, int | None, str]:
    """A whole answer: every choice there, each with why it ended."""
    if response.status_code != 200:
        return _error(response)
    try:
        choices = response.json()["choices"]
    except (ValueError, KeyError, TypeError):
        return "bad", 200, f"a 200 that is no answer: {response.text[:200]!r}"
    reasons = [c.get("finish_reason") for c in choices]
    if len(choices) != n or None in reasons:
        return "bad", 200, f"{len(choices)} choice(s) of {n}, finish reasons {reasons}"
    return "ok", 200, ""


def _streamed(events: list[bytes], n: int) -> tuple[str, int | None, str]:
    """A stream: `[DONE]` last and nothing after it; each choice finished exactly once, or an
    error event before `[DONE]` (choices cut short then say "abort")."""
    if not events or events[-1] != b"[DONE]":
        return "bad", 200, f"the stream ended without [DONE] after {len(events)} event(s)"
    if b"[DONE]" in events[:-1]:
        return "bad", 200, "[DONE] twice"
    finished: dict[int, int] = {}
    error = None
    for data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            continue
        if error is not None:
            return "bad", 200, "a chunk after the error event"
        for choice in chunk.get("choices", []):
            if choice.get("finish_reason") is not None:
                finished[choice["index"]] = finished.get(choice["index"], 0) + 1
    if any(count > 1 for count in finished.values()):
        return "bad", 200, f"a choice finished twice: {finished}"
    if error is not None:
        return "error", int(error.get("code") or 0), str(error.get("message"))[:200]
    if sorted(finished) != list(range(n)):
        return "bad", 200, f"choices finished: {sorted(finished)} of {n}"
    return "ok", 200, ""
