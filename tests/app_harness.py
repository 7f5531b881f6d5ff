"""The edge's ASGI app in-process over a stub engine, for tests of what the app itself decides
(keys, routes, error bodies, the stored responses' owners) without a model or a server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from triode.actors import EngineAdmin
from triode.edge.app import App
from triode.edge.settings import Settings


class StubIntake:
    """Tokenizes by bytes: each byte is a token."""

    chat_template = None

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    async def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def token_text(self, token: int) -> str:
        return chr(token)


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float


@dataclass
class StubEngine:
    """What the app reads of an engine when no request reaches it."""

    dead: BaseException | None = None
    intake: Any = field(default_factory=StubIntake)
    max_model_len: int = 2048
    vocab_size: int = 256
    model_dir: Path = Path("stub")
    stats: Any = field(default_factory=lambda: SchedulerStats(0, 0, 0.0))
    # weights never updated: every operation answers version 0
    admin: EngineAdmin = field(default_factory=lambda: EngineAdmin(_version_zero))

    async def seconds_stalled(self) -> float:
        return 0.0

    async def get_stats(self) -> dict[str, Any]:
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0.0}


async def _version_zero(method: str, *args: Any) -> list[Any]:
    if method != "weight_version":
        raise RuntimeError(f"the stub engine has no {method}")
    return [0]


def make_app(**settings: Any) -> App:
    settings.setdefault("served_model_names", ["m"])
    return App(StubEngine(), Settings(**settings))  # type: ignore[arg-type]


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


async def call(
    app: App,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    query: bytes = b"",
) -> Answer:
    """One request through `app`, whole: its status, headers and body (`body` as JSON, or
    bytes as they are)."""
    raw = body if isinstance(body, bytes) else b"" if body is None else msgspec.json.encode(body)
    all_headers = [(b"content-type", b"application/json"), *(headers or [])]
    if key is not None:
        all_headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {
        "type": "http", "method": method, "path": path, "root_path": "", "query_string": query,
        "headers": all_headers,
    }  # fmt: skip
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await trio.sleep_forever()  # the client stays until it has the answer
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Answer(start["status"], dict(start.get("headers", [])), content)
