"""The edge's ASGI app in-process over a stub engine, for tests of what the app itself decides
(keys, routes, error bodies, the stored responses' owners, the model a request runs) without a
model or a server."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from triode.actors import CompletionOutput, EngineAdmin, OperationError, RequestOutput
from triode.edge.app import App
from triode.edge.settings import Settings
from triode.wire import SamplingParams


@dataclass
class StubTemplate:
    source: str = "{% for m in messages %}{{ m.content }}{% endfor %}"


class StubIntake:
    """Tokenizes by bytes: each byte is a token. A chat is its messages' contents, joined."""

    chat_template: Any = StubTemplate()

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    async def encode_chat(
        self, messages: list[dict[str, Any]], **options: Any
    ) -> tuple[str, list[int]]:
        text = "".join(str(m.get("content") or "") for m in messages)
        return text, list(text.encode())

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
    """What the app reads of an engine, and a generation that answers at once: each choice's
    text is the name of the LoRA adapter it ran with ("base" for none). Its adapter registry
    (`loras`) refuses as the engine core's does; `list_loras` counts its calls."""

    dead: BaseException | None = None
    restarts: int = 0  # engine cores started again in dead ones' places
    intake: Any = field(default_factory=StubIntake)
    max_model_len: int = 2048
    block_size: int = 16
    data_parallel_size: int = 1
    kv_event_sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    vocab_size: int = 256
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    model_dir: Path = Path("stub")
    stats: Any = field(default_factory=lambda: SchedulerStats(0, 0, 0.0))
    admin: EngineAdmin = field(init=False)
    loras: dict[str, dict[str, Any]] = field(default_factory=dict)
    list_loras_calls: int = 0
    list_loras_delay: float = 0.0  # seconds each `list_loras` takes to answer
    generated: list[str | None] = field(default_factory=list)  # each generation's lora_name
    sampled: list[SamplingParams | None] = field(default_factory=list)  # and its params
    ranks: list[int | None] = field(default_factory=list)  # and the engine core it asked for
    finish_reason: str = "stop"  # why each generation ends ("abort": the engine let it go)
    _lora_ids: Any = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.admin = EngineAdmin(self._call_all)

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """The engine core's answers to `EngineAdmin`'s calls: the weights never updated
        (version 0), and the LoRA registry's."""
        await trio.lowlevel.checkpoint()
        if method == "weight_version":
            return [0]
        if method == "add_lora":
            return [self.add_lora(*args)]
        if method == "remove_lora":
            return [self.remove_lora(*args)]
        raise RuntimeError(f"the stub engine has no {method}")

    async def seconds_stalled(self) -> float:
        return 0.0

    async def get_stats(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_waiting_reqs,
            "kv_cache_usage": stats.kv_cache_usage,
        }

    async def list_loras(self) -> list[dict[str, Any]]:
        self.list_loras_calls += 1
        await trio.sleep(self.list_loras_delay)
        return [dict(entry) for entry in self.loras.values()]

    def add_lora(self, name: str, path: str, load_inplace: bool = False) -> dict[str, Any]:
        """Register an adapter as the engine core does (its refusals included)."""
        if name in self.loras and not load_inplace:
            raise OperationError("invalid", f"The lora adapter '{name}' has already been loaded.")
        if not path.startswith("/adapters/"):
            raise OperationError("invalid", f"{path!r} is not under --allowed-lora-paths")
        entry = {
            "name": name, "path": path, "lora_id": next(self._lora_ids),
            "digest": hashlib.sha256(path.encode()).hexdigest(), "rank": 8,
            "base_model_name": None,
        }  # fmt: skip
        self.loras[name] = entry
        return dict(entry)

    def remove_lora(self, name: str) -> dict[str, Any]:
        if name not in self.loras:
            raise OperationError("not_found", f"The lora adapter '{name}' cannot be found.")
        return self.loras.pop(name)

    async def generate(
        self,
        prompt: list[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_embeds: Any = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.generated.append(lora_name)
        self.ranks.append(data_parallel_rank)
        self.sampled.append(params)
        n = 1 if params is None else params.n
        await trio.lowlevel.checkpoint()
        if lora_name is not None and lora_name not in self.loras:
            why = f"the LoRA adapter {lora_name!r} is not loaded"
            outputs = [
                CompletionOutput(i, finish_reason="error", stop_reason=why) for i in range(n)
            ]
        else:
            text = lora_name or "base"
            outputs = [
                CompletionOutput(i, text, list(text.encode()), finish_reason=self.finish_reason)
                for i in range(n)
            ]
        yield RequestOutput(request_id or "", None, list(prompt or ()), outputs, finished=True)


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
