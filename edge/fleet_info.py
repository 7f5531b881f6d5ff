"""What the routers in front of a fleet ask an instance, in the shapes vllm-router (and the
SGLang gateway it comes from) reads: `/get_load` (its `power_of_two` policy), `/get_server_info`
and `/kv_event_sources` (its `kv_aware` policy finds an instance's KV-cache events there when
it was not told them).

All three need a key where keys are set: they name the model's directory and the event
endpoints, which carry prompt token ids. Each answer is a few hundred bytes, from state the
edge holds (`scheduler_gauges`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from triode.actors import EngineDeadError

from .http import Request, respond_json

if TYPE_CHECKING:
    from .app import App

# how long an answer waits for the engine's fresh stats before it takes the last step's
STATS_TIMEOUT = 1.0


async def scheduler_gauges(app: App) -> tuple[int, int, float]:
    """Requests running and waiting, and the KV cache's usage, over every engine core: the
    engine's own answer when it comes in time, else the stats of its last step. The engine's
    counters of that answer go to the app's metrics."""
    last = app.engine.stats
    gauges = (last.num_running_reqs, last.num_waiting_reqs, last.kv_cache_usage)
    if app.engine.dead is None:
        with trio.move_on_after(STATS_TIMEOUT), contextlib.suppress(EngineDeadError):
            fresh = await app.engine.get_stats()
            app.metrics.update_engine(fresh)
            gauges = (
                fresh["num_running_reqs"], fresh["num_waiting_reqs"], fresh["kv_cache_usage"]
            )  # fmt: skip
    return gauges


async def get_load(app: App, request: Request) -> None:
    """`{"load": N}`: the requests running and waiting, over every engine core."""
    running, waiting, _ = await scheduler_gauges(app)
    await respond_json(request.send, {"load": running + waiting})


async def get_server_info(app: App, request: Request) -> None:
    """The model and the cache's block size, which a router's prefix index must share."""
    engine = app.engine
    await respond_json(
        request.send,
        {
            "model_id": app.model_name,
            "model_path": str(engine.model_dir),
            "served_model_names": app.settings.served_model_names,
            "kv_block_size": engine.block_size,
            "max_model_len": engine.max_model_len,
            "data_parallel_size": engine.data_parallel_size,
            "kv_events": bool(engine.kv_event_sources),
        },
    )


async def kv_event_sources(app: App, request: Request) -> None:
    """Each data-parallel rank's KV-event endpoints (`--kv-events-config`), keyed by rank."""
    await respond_json(request.send, app.engine.kv_event_sources)
