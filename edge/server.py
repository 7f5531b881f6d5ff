"""`triode serve`: the engine core as a supervised child, the app in hypercorn's trio worker.

SIGINT and SIGTERM start a graceful shutdown: hypercorn stops accepting connections and gives
in-flight requests `graceful_timeout` seconds to finish, then the engine core is stopped
(graceful message, deadline, terminate, kill).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from triode.actors import open_engine

from .api_servers import serve_api_servers
from .app import open_app
from .asgi_server import serve_asgi
from .settings import Settings

log = logging.getLogger("triode.serve")


@dataclass
class ServeOptions:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    root_path: str = ""
    graceful_timeout: float = 10.0
    api_server_count: int = 1


async def serve(
    options: ServeOptions,
    settings: Callable[[Any], Settings],
    engine_args: dict[str, Any],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation). `settings(engine)` builds the app's
    settings once the engine is up (`settings(None)` with several API servers); `task_status`
    gets the bound URLs. With `options.api_server_count` > 1 the app runs in that many
    processes (`api_servers.py`)."""
    if options.api_server_count > 1:
        await serve_api_servers(
            model=options.model,
            engine_args=engine_args,
            settings=settings(None),
            count=options.api_server_count,
            host=options.host,
            port=options.port,
            root_path=options.root_path,
            graceful_timeout=options.graceful_timeout,
            announce=lambda url: log.info(
                "serving the OpenAI API on %s%s/v1 from %d processes",
                url,
                options.root_path,
                options.api_server_count,
            ),
            task_status=task_status,
        )
        return
    started = time.perf_counter()
    log.info("starting the engine core for %s", options.model or "the default model")
    async with open_engine(options.model, **engine_args) as engine:
        log.info(
            "engine ready in %.1fs (engine core pid %s): %s, %s, max_model_len %d, "
            "%d KV blocks of %d tokens",
            time.perf_counter() - started,
            ", ".join(map(str, engine.pids)),
            engine.model_dir,
            engine.dtype,
            engine.max_model_len,
            engine.num_kv_blocks,
            engine.block_size,
        )
        async with open_app(engine, settings(engine)) as app:
            await serve_asgi(
                app,
                host=options.host,
                port=options.port,
                root_path=options.root_path,
                graceful_timeout=options.graceful_timeout,
                announce=lambda url: log.info(
                    "serving the OpenAI API on %s%s/v1", url, options.root_path
                ),
                task_status=task_status,
            )
        log.info("server stopped; stopping the engine core")
