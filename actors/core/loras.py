"""The engine core's LoRA adapters: the names it serves them under, which of them the ranks
hold, and which of them a step may run.

An adapter is registered under a name (`--lora-modules` at start, `add_lora` at run time) with
an id that is never used again, and the content digest the ranks read from its files: the
digest, not the name, roots the block hashes of its requests (`kv_cache.hash_root`), so two
adapters, or one name loaded again with new weights, never share cached KV. A request holds its
adapter's entry from when it is queued until it leaves (`Request.release_lora`): unloading the
name, or loading another adapter in its place, retires the entry, and its tensors leave the
ranks once no request holds it.

At most `max_cpu_loras` adapters are resident on the ranks; a request whose adapter is not
waits while the engine core loads it, the least recently used adapter no running request uses
going first; at most `max_loras` distinct adapters run in one step. Every worker call happens
with the step loop held (`EngineCore.hold`) and one at a time (`_lock`, and the executor's own
lock against the administrative operations').
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from triode.wire.messages import EngineCoreOutput, FinishReason
from triode.wire.operations import OperationError

from ..config import EngineArgs
from ..lora_modules import LoRAModule, lora_name_problem
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .engine_core import EngineCore

log = logging.getLogger(__name__)

# why the step loop is held while the ranks load or drop adapters (`EngineCore.holds`)
LORA_HOLD = "lora adapters"
# the most adapter names one engine core serves at once: each costs a little memory here and
# a name in /v1/models, and a client must not grow the list without bound
MAX_ADAPTERS = 1024
MAX_PATH = 4096
# the UTILITY methods (`utilities.call_utility`)
METHODS = frozenset({"add_lora", "remove_lora", "list_loras"})


@dataclass(frozen=True)
class LoRASettings:
    """The engine arguments the registry works by."""

    enabled: bool = False
    max_loras: int = 1
    max_cpu_loras: int = 1
    allowed_paths: tuple[str, ...] = ()
    modules: tuple[LoRAModule, ...] = ()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LoRASettings:
        return cls(
            enabled=args.enable_lora,
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras or args.max_loras,
            allowed_paths=tuple(args.allowed_lora_paths),
            modules=tuple(args.lora_module_list()),
        )


class LoRAEntry:
    """One registered adapter. `users` counts the live requests that hold it; `real_path` is
    what the ranks read (the path resolved when it was registered)."""

    __slots__ = (
        "base_model_name",
        "digest",
        "lora_id",
        "name",
        "nbytes",
        "path",
        "rank",
        "real_path",
        "users",
    )

    def __init__(
        self, name: str, path: str, real_path: str, lora_id: int, base_model_name: str | None
    ) -> None:
        self.name = name
        self.path = path
        self.real_path = real_path
        self.lora_id = lora_id
        self.base_model_name = base_model_name
        self.digest = ""  # the ranks' SHA-256 of its files, once loaded
        self.rank = 0
        self.nbytes = 0  # over all ranks
        self.users = 0

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "lora_id": self.lora_id,
            "digest": self.digest,
            "rank": self.rank,
            "base_model_name": self.base_model_name,
        }

    def __repr__(self) -> str:
        return f"LoRAEntry({self.name!r}, id={self.lora_id}, users={self.users})"


class LoRARegistry:
    """The adapters of one engine core (`EngineCore.loras`). The scheduler asks it which
    waiting requests may start (`admits`); the engine core has it load what they wait for
    (`tend`) and answers the UTILITY methods `add_lora`, `remove_lora` and `list_loras`."""

    def __init__(self, core: EngineCore, settings: LoRASettings) -> None:
        self.core = core
        self.settings = settings
        self.named: dict[str, LoRAEntry] = {}
        # on the ranks, least recently admitted first
        self.resident: OrderedDict[int, LoRAEntry] = OrderedDict()
        # entries no longer named that requests still hold, or whose tensors are still out
        self.retired: dict[int, LoRAEntry] = {}
        # adapters that waiting requests need on the ranks (`admits`)
        self.wanted: dict[int, LoRAEntry] = {}
        self._ids = itertools.count(1)
        self._lock = trio.Lock()
        self._tending = False
        self._allowed = tuple(os.path.realpath(p) for p in settings.allowed_paths)
        # resolved once, here (the engine core's working directory resolves relative ones)
        self._module_paths = {m.name: os.path.realpath(m.path) for m in settings.modules}
        self.loads = 0
        self.evictions = 0

    # the scheduler's side

    def resolve(self, name: str) -> LoRAEntry | None:
        """The entry a new request naming `name` runs with, or None: not loaded."""
        return self.named.get(name)

    @staticmethod
    def active(running: Iterable[Request]) -> set[int]:
        """The ids of the adapters that running requests use."""
        return {r.lora.lora_id for r in running if r.lora is not None}

    def admits(self, entry: LoRAEntry, adapters: set[int]) -> bool:
        """Whether a request with `entry` may start in this step beside the adapters of
        `adapters` (which it then joins): not past `max_loras` distinct ones, and only once
        the ranks hold it; else it waits, and one that waits for its load asks for it."""
        if entry.lora_id not in adapters:
            if len(adapters) >= self.settings.max_loras:
                return False
            if entry.lora_id not in self.resident:
                self.wanted[entry.lora_id] = entry
                return False
            adapters.add(entry.lora_id)
        self.resident.move_to_end(entry.lora_id)
        return True

    # the engine core's side

    def tend(self) -> None:
        """Start loading what waiting requests want, and dropping retired adapters no request
        holds, in a task beside the step loop, unless one is at it or nothing is to do."""
        if self._tending or not (self.wanted or self._idle_retired()):
            return
        self._tending = True
        self.core.spawn(self._tend)

    async def load_modules(self) -> None:
        """Load `--lora-modules`, before the engine core runs its step loop: a failure is
        the engine's failure to start, with the workers' message."""
        for module in self.settings.modules:
            try:
                async with self._lock:
                    await self._add(
                        module.name,
                        module.path,
                        self._module_paths[module.name],
                        module.base_model_name,
                    )
            except OperationError as e:
                raise RuntimeError(
                    f"--lora-modules {module.name}={module.path}: {e.message}"
                ) from None

    async def restore(self, name: str, path: str, digest: str, base_model_name: str | None) -> None:
        """Load again an adapter a dead predecessor served (`standing.restore`), before the
        step loop runs: refused unless its path is still allowed and its files still have
        `digest`."""
        real_path = self._allowed_path(path)
        async with self._lock:
            await self._add(name, path, real_path, base_model_name, digest)

    # UTILITY methods

    async def add_lora(
        self,
        name: str,
        path: str,
        load_inplace: bool = False,
        base_model_name: str | None = None,
    ) -> dict[str, Any]:
        """Load the PEFT adapter at `path` under `name`. With `load_inplace`, an adapter
        already under that name is replaced: requests that hold it finish on it. Refused with
        `unsupported` (LoRA not enabled), `invalid` (a bad name or path, a name taken, a bad
        adapter: the ranks' message) or `conflict` (too many adapters, or no room on the ranks
        for now)."""
        self._check_enabled()
        problem = lora_name_problem(name)
        if problem is not None:
            raise OperationError("invalid", problem)
        if not isinstance(load_inplace, bool):
            raise OperationError("invalid", "load_inplace must be a boolean")
        if base_model_name is not None and not (
            isinstance(base_model_name, str) and len(base_model_name) <= MAX_PATH
        ):
            raise OperationError("invalid", "base_model_name must be a short string")
        real_path = self._allowed_path(path)
        async with self._lock:
            old = self.named.get(name)
            if old is not None and not load_inplace:
                raise OperationError(
                    "invalid", f"The lora adapter '{name}' has already been loaded."
                )
            if old is None and len(self.named) >= MAX_ADAPTERS:
                raise OperationError(
                    "conflict", f"{MAX_ADAPTERS} LoRA adapters are loaded: unload one first"
                )
            async with self._held():
                entry = await self._add(name, path, real_path, base_model_name)
                if old is not None:
                    self.retired[old.lora_id] = old
                    await self._drop_idle_retired()
        self.core.record_standing()
        return entry.describe()

    async def remove_lora(self, name: str) -> dict[str, Any]:
        """Stop serving `name` (`not_found` if it is not served): requests that hold it
        finish on it, and its tensors leave the ranks once none does."""
        self._check_enabled()
        async with self._lock:
            entry = self.named.get(name) if isinstance(name, str) else None
            if entry is None:
                raise OperationError("not_found", f"The lora adapter '{name}' cannot be found.")
            del self.named[name]
            self.retired[entry.lora_id] = entry
            if self._idle_retired():
                async with self._held():
                    await self._drop_idle_retired()
        self.core.record_standing()
        return entry.describe()

    def list_loras(self) -> list[dict[str, Any]]:
        """The adapters served, in the order they were loaded."""
        return [e.describe() for e in sorted(self.named.values(), key=lambda e: e.lora_id)]

    # on the ranks

    async def _add(
        self,
        name: str,
        path: str,
        real_path: str,
        base_model_name: str | None,
        digest: str = "",
    ) -> LoRAEntry:
        entry = LoRAEntry(name, path, real_path, next(self._ids), base_model_name)
        entry.digest = digest  # the ranks refuse files that do not have it
        await self._make_room()
        await self._load(entry)
        self.named[name] = entry
        return entry

    async def _load(self, entry: LoRAEntry) -> None:
        """Load `entry` on every rank (again: its files must still have its digest). Ranks
        that read different files, or that loaded it when another refused, let it go."""
        started = time.perf_counter()
        kwargs: dict[str, Any] = {"lora_id": entry.lora_id, "path": entry.real_path}
        if entry.digest:
            kwargs["digest"] = entry.digest
        try:
            results = await self.core.executor.call_workers("add_lora", **kwargs)
        except Exception:
            await self._forget_on_ranks(entry)
            raise
        digests = {r.get("digest") for r in results}
        if len(digests) != 1:
            await self._forget_on_ranks(entry)
            raise OperationError(
                "invalid",
                f"the ranks read different files for the LoRA adapter {entry.name!r} at "
                f"{entry.path} (did they change while it loaded?)",
            )
        entry.digest = str(digests.pop())
        entry.rank = int(results[0].get("rank", 0))
        entry.nbytes = sum(int(r.get("bytes", 0)) for r in results)
        self.resident[entry.lora_id] = entry
        self.loads += 1
        log.info(
            "LoRA adapter %r loaded as id %d: rank %d, %d bytes, %.3f s",
            entry.name,
            entry.lora_id,
            entry.rank,
            entry.nbytes,
            time.perf_counter() - started,
        )

    async def _forget_on_ranks(self, entry: LoRAEntry) -> None:
        """After a failed load: the ranks that took it let it go (unknown ids are ignored)."""
        try:
            await self.core.executor.call_workers("remove_lora", lora_ids=[entry.lora_id])
        except Exception as e:
            log.warning("the ranks could not drop LoRA id %d: %s", entry.lora_id, e)

    async def _evict(self, entries: list[LoRAEntry], why: str) -> None:
        started = time.perf_counter()
        await self.core.executor.call_workers("remove_lora", lora_ids=[e.lora_id for e in entries])
        seconds = time.perf_counter() - started
        for entry in entries:
            del self.resident[entry.lora_id]
            self.evictions += 1
            log.info(
                "LoRA adapter %r (id %d, rank %d, %d bytes) dropped from the ranks (%s) in %.3f s",
                entry.name,
                entry.lora_id,
                entry.rank,
                entry.nbytes,
                why,
                seconds,
            )

    async def _make_room(self) -> None:
        """Make room on the ranks for one more adapter: drop the least recently used that no
        running request uses. `conflict` when every resident one is in use."""
        if len(self.resident) < self.settings.max_cpu_loras:
            return
        victim = self._victim()
        if victim is None:
            raise OperationError(
                "conflict",
                f"all {len(self.resident)} LoRA adapters on the ranks are in use by running "
                "requests (--max-cpu-loras); try again once they finish",
            )
        await self._evict([victim], "least recently used")

    def _victim(self) -> LoRAEntry | None:
        if len(self.resident) < self.settings.max_cpu_loras:
            return None
        active = self.active(self.core.scheduler.running)
        return next((e for e in self.resident.values() if e.lora_id not in active), None)

    def _room_for(self, entry: LoRAEntry) -> bool:
        """Whether a load of `entry`, which waiting requests want, can go ahead now."""
        if entry.lora_id in self.resident or not entry.users:
            return False
        return len(self.resident) < self.settings.max_cpu_loras or self._victim() is not None

    def _idle_retired(self) -> list[LoRAEntry]:
        """Retired entries no request holds; those not on the ranks are forgotten now."""
        idle = [e for e in self.retired.values() if not e.users]
        for entry in idle:
            if entry.lora_id not in self.resident:
                del self.retired[entry.lora_id]
        return [e for e in idle if e.lora_id in self.resident]

    async def _drop_idle_retired(self) -> None:
        idle = self._idle_retired()
        if idle:
            await self._evict(idle, "unloaded")
            for entry in idle:
                del self.retired[entry.lora_id]

    async def _tend(self) -> None:
        held = False
        try:
            async with self._lock:
                while True:
                    drop = self._idle_retired()
                    load = next((e for e in self.wanted.values() if self._room_for(e)), None)
                    if not drop and load is None:
                        self.wanted.clear()  # asked for again by requests still waiting
                        self._tending = False
                        return
                    if not held:  # the step loop parks first: look again after
                        await self.core.hold(LORA_HOLD)
                        held = True
                        continue
                    if drop:
                        await self._drop_idle_retired()
                        continue
                    del self.wanted[load.lora_id]
                    await self._reload(load)
        except Exception:  # the engine core must go on; the requests wait or were failed
            log.exception("loading or dropping LoRA adapters failed")
        finally:
            self._tending = False
            if held:
                self.core.release(LORA_HOLD)

    async def _reload(self, entry: LoRAEntry) -> None:
        """Load an adapter that waiting requests want again; if it cannot be (its files
        changed or went), they finish with an error."""
        try:
            await self._make_room()
            await self._load(entry)
        except OperationError as e:
            reason = f"the LoRA adapter {entry.name!r} could not be loaded: {e.message}"
            log.warning("%s", reason)
            await self.core.tell(self._fail_waiting(entry, reason))

    def _fail_waiting(self, entry: LoRAEntry, reason: str) -> list[tuple[int, EngineCoreOutput]]:
        scheduler = self.core.scheduler
        failed = [r for r in scheduler.waiting if r.lora is entry]
        for req in failed:
            scheduler.waiting.remove(req)
            req.stop_reason = reason
            scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return [
            (
                r.client_index,
                EngineCoreOutput(
                    r.request_id, finish_reason=FinishReason.ERROR, stop_reason=reason
                ),
            )
            for r in failed
        ]

    @asynccontextmanager
    async def _held(self) -> AsyncIterator[None]:
        await self.core.hold(LORA_HOLD)
        try:
            yield
        finally:
            self.core.release(LORA_HOLD)

    def _check_enabled(self) -> None:
        if not self.settings.enabled:
            raise OperationError(
                "unsupported", "LoRA adapters are not enabled: start the server with --enable-lora"
            )

    def _allowed_path(self, path: Any) -> str:
        """The real path of `path` when adapters may be loaded from it: a directory under
        one of --allowed-lora-paths, or exactly a --lora-modules path."""
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH or "\0" in path:
            raise OperationError(
                "invalid", f"lora_path must be a path of 1 to {MAX_PATH} characters"
            )
        # not in a worker thread: a few stat calls on the engine's own host, for a rare admin
        # call (the ranks read the same files right after anyway); a thread let virtual-time
        # tests race the step loop
        real = os.path.realpath(path)
        if real in self._module_paths.values() or any(
            os.path.commonpath([real, allowed]) == allowed for allowed in self._allowed
        ):
            return real
        raise OperationError("invalid", f"the LoRA path {path!r} is not under --allowed-lora-paths")
