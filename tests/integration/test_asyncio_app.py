"""asyncio servers on tiny-random: triode's own ASGI app under uvicorn (`edge.asyncio_app`), and
a Starlette app whose handler calls `triode.actors.asyncio`'s `generate`."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from processes import alive
from prometheus_client.parser import text_string_to_metric_families
from server import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from triode.actors import SamplingParams
from triode.actors.asyncio import open_engine
from triode.edge.asyncio_app import AsyncioASGI, create_app
from triode.edge.settings import Settings

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 2048}
NAME = "tiny"
PROMPT = [5, 17, 42, 9, 100, 3]
START_TIMEOUT = 60.0


@dataclass
class Uvicorn:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def serving(app: Any) -> Iterator[Uvicorn]:
    """`app` under uvicorn (asyncio, lifespan on) in a thread, on a free loopback port."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn")
    thread.start()
    running = Uvicorn(f"http://127.0.0.1:{port}", server, thread)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.05)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def triode_app() -> Iterator[tuple[Uvicorn, AsyncioASGI]]:
    app = create_app("tiny-random", settings=Settings(served_model_names=[NAME]), **ENGINE_ARGS)
    with serving(app) as server:
        yield server, app


GAUGES = (
    "triode:num_requests_running",
    "triode:num_requests_waiting",
    "triode:kv_cache_usage_perc",
)


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return {s.name: s.value for family in families for s in family.samples if s.name in GAUGES}


def test_chat_completion_and_its_stream_agree(triode_app: tuple[Uvicorn, AsyncioASGI]) -> None:
    server, _ = triode_app
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    assert "".join(pieces) == whole.choices[0].message.content


def test_a_client_disconnecting_mid_stream_frees_the_kv_blocks(
    triode_app: tuple[Uvicorn, AsyncioASGI],
) -> None:
    server, _ = triode_app
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        next(chunks)
        assert _gauges(server.url)["triode:kv_cache_usage_perc"] > 0
    # 1800 tokens take seconds; an abort frees the blocks at once
    deadline = time.monotonic() + 2.0
    while (gauges := _gauges(server.url))["triode:kv_cache_usage_perc"] > 0:
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)
    assert gauges["triode:num_requests_running"] == 0
    assert gauges["triode:num_requests_waiting"] == 0


def _starlette_app() -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with open_engine("tiny-random", **ENGINE_ARGS) as engine:
            app.state.engine = engine
            yield

    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], ignore_eos=True)
        final = None
        async for out in request.app.state.engine.generate(body["prompt"], params):
            final = out
        assert final is not None
        completion = final.outputs[0]
        return JSONResponse({"text": completion.text, "token_ids": completion.token_ids})

    async def stats(request: Request) -> JSONResponse:
        engine = request.app.state.engine
        return JSONResponse({"pid": engine.pid, **(await engine.get_stats())})

    routes = [Route("/generate", generate, methods=["POST"]), Route("/stats", stats)]
    return Starlette(routes=routes, lifespan=lifespan)


def test_a_starlette_app_generates_with_the_asyncio_engine(
    triode_app: tuple[Uvicorn, AsyncioASGI],
) -> None:
    triode_server, _ = triode_app
    greedy = {"model": NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0,
              "ignore_eos": True}  # fmt: skip
    completion = httpx.post(f"{triode_server.url}/v1/completions", json=greedy, timeout=30)
    reference = completion.json()["choices"][0]["text"]
    with serving(_starlette_app()) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            got = client.post("/generate", json={"prompt": PROMPT, "max_tokens": 10}).json()
            stats = client.get("/stats").json()
        pid = stats["pid"]
        assert alive(pid)
    assert len(got["token_ids"]) == 10
    assert got["text"] == reference
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not alive(pid)


def test_lifespan_shutdown_stops_the_engine() -> None:
    # a server of its own: stopping the module's would leave the other tests none
    app = create_app("tiny-random", settings=Settings(served_model_names=[NAME]), **ENGINE_ARGS)
    with serving(app) as server:
        assert app.trio_app is not None
        pid = app.trio_app.engine.pid  # type: ignore[attr-defined]
        assert alive(pid)
        server.stop()
        assert app.trio_app is None
        assert not alive(pid)
