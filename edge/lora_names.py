"""The LoRA adapters a request's `model` may name, as this API server knows them.

A request's `model` is a served model name (the base model), the name of an adapter the engine
has loaded (the request runs with it), or a 404. The engine core holds the registry; each API
server keeps a copy (`LoraNames`), filled at start and after each load or unload it serves. An
adapter loaded elsewhere (another API server, the embedding API) is learnt on a miss: a `model`
this copy does not know refreshes it before the 404, at most once per `REFRESH_INTERVAL`, and
misses that come while one refresh is under way wait for it, so a flood of unknown names costs
the engine one `list_loras` a second, not one a request.

The startup check of `--lora-modules` (`lora_modules_problem`) is here too: adapter names and
served names are one namespace.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from typing import Any, Final

import trio

from triode.actors import Engine, EngineDeadError, OperationError, parse_lora_module

from .errors import APIError

log = logging.getLogger(__name__)

# The least time between two refreshes that a miss (or /v1/models) asks for.
REFRESH_INTERVAL: Final = 1.0
# How long a refresh waits for the engine's answer; then the names stay as they were.
LIST_TIMEOUT: Final = 1.0


def model_not_found(name: str) -> APIError:
    """The 404 for a `model` that is neither served nor a loaded adapter."""
    return APIError(
        404, f"the model {name!r} does not exist", param="model", code="model_not_found"
    )


class LoraNames:
    """The adapters of one engine as this API server last heard them (`list_loras`' entries:
    name, path, lora_id, digest, rank, base_model_name), and the pick of a request's `model`."""

    def __init__(self, engine: Engine, served_model_names: list[str]) -> None:
        self._engine = engine
        self._served = served_model_names
        self._adapters: dict[str, dict[str, Any]] = {}
        self._refreshed_at = -math.inf
        self._refreshing: trio.Event | None = None

    @property
    def adapters(self) -> list[dict[str, Any]]:
        """The adapters as last heard, in the engine's order."""
        return list(self._adapters.values())

    async def pick(self, model: str | None) -> str | None:
        """The adapter a request for `model` runs with: None for the base model (a served
        name, or no name), else the adapter's name. A checkpoint only on a miss (a refresh);
        raises the 404 `model_not_found` for a name that is still unknown after it."""
        if model is None or model in self._served:
            return None
        if model not in self._adapters:
            await self.refresh_if_stale()
            if model not in self._adapters:
                raise model_not_found(model)
        return model

    async def refresh_if_stale(self) -> None:
        """Refresh unless one finished within `REFRESH_INTERVAL`; wait for one under way. A
        checkpoint; never raises (a failed refresh keeps the names as they were)."""
        if self._refreshing is not None:
            await self._refreshing.wait()
        elif trio.current_time() - self._refreshed_at >= REFRESH_INTERVAL:
            await self._fetch()
        else:
            await trio.lowlevel.checkpoint()

    async def refresh(self) -> None:
        """Ask the engine now, after any refresh under way (which may have asked before a
        change this caller made). A checkpoint; never raises."""
        while self._refreshing is not None:
            await self._refreshing.wait()
        await self._fetch()

    async def _fetch(self) -> None:
        done = self._refreshing = trio.Event()
        try:
            with trio.move_on_after(LIST_TIMEOUT) as waited:
                listed = await self._engine.list_loras()
                self._adapters = {entry["name"]: entry for entry in listed}
            if waited.cancelled_caught:
                log.warning("the engine did not list its LoRA adapters within %ss", LIST_TIMEOUT)
        except (OperationError, EngineDeadError, RuntimeError) as e:
            log.warning("listing the engine's LoRA adapters failed: %s", e)
        finally:
            # a cancelled refresh counts too: its waiters answer from the names as they are
            self._refreshed_at = trio.current_time()
            self._refreshing = None
            done.set()


def lora_modules_problem(
    specs: Iterable[str | dict[str, Any]], served_model_names: Iterable[str]
) -> str | None:
    """Why `lora_modules` (`name=path`, vLLM's JSON, or a dict of it from Python) cannot serve
    beside these served names, or None: an entry that does not read as one, or an adapter
    named like a served model (which a request could never reach: that name runs the base)."""
    served = set(served_model_names)
    for spec in specs:
        text = json.dumps(spec) if isinstance(spec, dict) else spec
        try:
            name = parse_lora_module(text).name
        except ValueError as e:
            return str(e)
        if name in served:
            return (
                f"--lora-modules: {name!r} is also a served model name (--served-model-name); "
                "give the adapter another name"
            )
    return None
