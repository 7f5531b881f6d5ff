"""triode's ASGI app under an asyncio server (uvicorn), through trio's guest mode.

```python
import uvicorn
from triode.edge.asyncio_app import create_app

uvicorn.run(create_app("tiny-random", max_num_seqs=16), host="127.0.0.1", port=8000)
```

The wrapper owns lifespan: startup opens the loop's trio guest run and, in it, the engine and
the app; shutdown closes them. Each HTTP call then runs the trio app in the guest run, its
`receive` and `send` being uvicorn's, called as asyncio tasks; a client that disconnects reaches
the app as `http.disconnect`, which aborts its generation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from triode.actors import Bridge, open_bridge, open_engine

from .app import default_served_model_name, open_app
from .http import Message, Receive, Scope, Send
from .lora_names import lora_modules_problem
from .settings import Settings

log = logging.getLogger(__name__)

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AsyncioASGI:
    """An asyncio ASGI app serving the trio ASGI app that `open_trio_app()` (a trio async
    context manager, entered in the guest run at lifespan startup) yields."""

    def __init__(self, open_trio_app: Callable[[], AbstractAsyncContextManager[ASGIApp]]) -> None:
        self._open_trio_app = open_trio_app
        self._running: tuple[Bridge, ASGIApp] | None = None

    @property
    def trio_app(self) -> ASGIApp | None:
        """The trio app while it serves (from lifespan startup to shutdown), else None."""
        return None if self._running is None else self._running[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self._running is None:
            raise RuntimeError("the app serves after lifespan startup: run uvicorn with lifespan")
        bridge, app = self._running

        async def trio_receive() -> Message:
            return await bridge.run_asyncio(receive)

        async def trio_send(message: Message) -> None:
            await bridge.run_asyncio(send, message)

        await bridge.run(app, scope, trio_receive, trio_send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup: ASGI's first message
        started = False
        try:
            async with open_bridge() as bridge, bridge.enter(self._open_trio_app) as app:
                self._running = bridge, app
                await send({"type": "lifespan.startup.complete"})
                started = True
                while (await receive())["type"] != "lifespan.shutdown":
                    pass
                self._running = None
        except Exception as e:
            self._running = None
            log.exception("lifespan %s failed", "shutdown" if started else "startup")
            failed = "lifespan.shutdown.failed" if started else "lifespan.startup.failed"
            await send({"type": failed, "message": repr(e)})
            return
        await send({"type": "lifespan.shutdown.complete"})


def asyncio_asgi(open_trio_app: Callable[[], AbstractAsyncContextManager[ASGIApp]]) -> AsyncioASGI:
    """The trio ASGI app that `open_trio_app()` yields, as an asyncio ASGI app. A trio app
    that needs nothing opened is `asyncio_asgi(lambda: contextlib.nullcontext(app))`."""
    return AsyncioASGI(open_trio_app)


def create_app(
    model: str | None = None, *, settings: Settings | None = None, **engine_args: Any
) -> AsyncioASGI:
    """triode's OpenAI-compatible API as an asyncio ASGI app, for `uvicorn.run(...)`: its
    lifespan starts the engine for `model` (`engine_args` are `EngineArgs` fields) and stops
    it. `settings` default to serving under the model's name with no API keys. Raises
    ValueError for `lora_modules` that cannot serve beside the served names."""
    settings = settings or Settings(served_model_names=[default_served_model_name(model)])
    problem = lora_modules_problem(engine_args.get("lora_modules", ()), settings.served_model_names)
    if problem is not None:
        raise ValueError(problem)
    return AsyncioASGI(functools.partial(_open_triode_app, model, engine_args, settings))


@contextlib.asynccontextmanager
async def _open_triode_app(
    model: str | None, engine_args: dict[str, Any], settings: Settings
) -> AsyncIterator[ASGIApp]:
    async with open_engine(model, **engine_args) as engine, open_app(engine, settings) as app:
        yield app
