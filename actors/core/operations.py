"""The engine core's administrative operations (UTILITY calls, `triode.actors.admin` on the
client side): sleep and wake, pause and resume, the prefix cache, profiling, new weights.

Each runs as a task of its own beside the input actor. One at a time: a second while one runs is
refused (`conflict`), as are the calls that make no sense in the engine's state (a sleep while
asleep, an update not started). What reaches the model goes to every rank (`call_workers`) with
no step in flight: the step loop is held (`EngineCore.hold`) and parks first. Memory that sleep
gives back is memory no cached prefix may point into, and weights that change make every cached
prefix stale: both forget the prefix cache, so nothing computed before is ever served after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from triode.wire.operations import OperationError
from triode.wire.weight_update import unlink_buckets

from .step_timeline import StepTimeline

if TYPE_CHECKING:
    from .engine_core import EngineCore

log = logging.getLogger(__name__)

SLEEP_TAGS = ("kv_cache", "weights")
LEVEL_TAGS = {0: (), 1: ("kv_cache",), 2: ("kv_cache", "weights")}
PAUSE_MODES = ("abort", "wait", "keep")
MAX_MODEL_PATH = 4096
# a trainer's update that no call touched for this long is finished by the engine itself: a
# trainer that died between start and finish must not leave the engine held for good
UPDATE_IDLE_TIMEOUT = 300.0
# a profile nobody stops is stopped, and written, after this long: torch's profiler keeps every
# event in memory until it stops, so one left running would grow without bound
MAX_PROFILE_SECONDS = 600.0


class Hold:
    """Why the step loop takes no step (`EngineCore.holds`)."""

    SLEEP = "sleep"
    PAUSE = "pause"
    UPDATE = "weight update"  # between start_weight_update and finish_weight_update
    CALL = "operation"  # a call on the workers


class EngineOperations:
    """The operations' state and the UTILITY methods that act on it."""

    METHODS = frozenset(
        {
            "sleep", "wake_up", "is_sleeping", "pause", "resume", "is_paused",
            "reset_prefix_cache", "start_profile", "stop_profile", "memory",
            "update_weights_from_disk", "init_weight_transfer_engine", "start_weight_update",
            "update_weights", "finish_weight_update", "weight_version",
        }
    )  # fmt: skip

    def __init__(self, core: EngineCore, *, profiler_dir: str | None, world_size: int) -> None:
        self.core = core
        self.profiler_dir = profiler_dir
        self.world_size = world_size  # ranks per engine core
        self.asleep: set[str] = set()  # the memory given back (`SLEEP_TAGS`)
        self.paused: str | None = None  # the pause's mode
        self.version = 0
        self.from_source = True  # the weights are their on-disk source's (not a trainer's)
        # the checkpoint of the last update_weights_from_disk (None: the served model's own)
        self.weights_path: str | None = None
        self.transfer: str | None = None  # the weight transfer backend, once initialised
        self.updating = False  # between start_weight_update and finish_weight_update
        self._touched = 0.0  # when a call of the open update last came (trio's clock)
        self.timeline = StepTimeline()
        self._busy: str | None = None
        self._drained: trio.Event | None = None  # while a `wait` pause waits
        # where update_weights_from_disk may read, as real paths: under these, or the served
        # model's own directory (`allow_weight_paths`)
        self._weight_paths: tuple[str, ...] = ()

    def check_weight_path(self, model_path: str) -> None:
        """OperationError unless `model_path` is the served model's own directory or lies under
        one of --allowed-weight-paths, symbolic links resolved: an admin key reads weights
        only where the operator said. Not in a worker thread: a few stat calls on the
        engine's own host, for a rare admin call (the ranks read the files right after)."""
        real = os.path.realpath(model_path)
        if real == os.path.realpath(self.core.executor.model_dir):
            return
        if not any(os.path.commonpath([real, p]) == p for p in self._weight_paths):
            raise OperationError(
                "invalid",
                f"the path {model_path!r} is neither the served model's directory nor under "
                "--allowed-weight-paths",
            )

    def allow_weight_paths(self, paths: list[str]) -> None:
        """--allowed-weight-paths, resolved once, here (the engine core's working directory
        resolves relative ones)."""
        self._weight_paths = tuple(os.path.realpath(p) for p in paths)

    # sleep and wake

    async def sleep(self, level: int = 1, tags: list[str] | None = None) -> dict[str, Any]:
        level = _choice("level", level, tuple(LEVEL_TAGS))
        free = set(_tags(tags)) if tags else set(LEVEL_TAGS[level])
        core = self.core
        with self._operation("sleep"):
            if free & self.asleep or (not free and Hold.SLEEP in core.holds):
                raise OperationError("conflict", "the engine is already asleep")
            if "kv_cache" in free and core.scheduler.connector is not None:
                raise OperationError(
                    "unsupported",
                    "the KV cache cannot sleep with a KV connector (other instances read it)",
                )
            held_before = Hold.SLEEP in core.holds
            await core.hold(Hold.SLEEP)
            preempted = 0
            if "kv_cache" in free:  # the memory goes: what it held is computed again
                preempted = core.scheduler.preempt_all()
                core.scheduler.reset_prefix_cache()
            started = time.perf_counter()
            try:
                results = await core.executor.call_workers(
                    "sleep" if free else "memory", **({"tags": sorted(free)} if free else {})
                )
            except OperationError:  # every rank refused alike: nothing went
                if not held_before and not self.asleep:
                    core.release(Hold.SLEEP)
                raise
            except BaseException:
                # some ranks may have let go: a wake takes it all back
                self.asleep |= free
                raise
            self.asleep |= free
            return {
                "is_sleeping": True,
                "level": level,
                "asleep": sorted(self.asleep),
                "preempted": preempted,
                "seconds": time.perf_counter() - started,
                **memory(results),
            }

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        wake = (set(_tags(tags)) if tags else set(SLEEP_TAGS)) & self.asleep
        core = self.core
        with self._operation("wake_up"):
            started = time.perf_counter()
            if wake:
                results = await core.executor.call_workers("wake_up", tags=sorted(wake))
                self.asleep -= wake
                if "weights" in wake and not self.from_source:
                    log.warning(
                        "the weights woke from their source on disk: the weights a trainer "
                        "pushed since went with the sleep"
                    )
                    self._new_version(from_source=True)
            else:
                results = await self._on_workers("memory")
            if not self.asleep:
                core.release(Hold.SLEEP)
            return {
                "is_sleeping": self.is_sleeping(),
                "asleep": sorted(self.asleep),
                "seconds": time.perf_counter() - started,
                **memory(results),
            }

    def is_sleeping(self) -> bool:
        return Hold.SLEEP in self.core.holds

    async def memory(self) -> dict[str, Any]:
        """The resident memory of the engine core's process and of each rank's."""
        return memory(await self._on_workers("memory"))

    # pause and resume

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        mode = _choice("mode", mode, PAUSE_MODES)
        core, scheduler = self.core, self.core.scheduler
        with self._operation("pause"):
            if self.paused is not None:
                raise OperationError("conflict", f"the engine is already paused ({self.paused})")
            aborted = 0
            if mode == "wait":  # the started requests finish; nothing new starts
                scheduler.admitting = False
                self._drained = trio.Event()
                self.check_drained()
                try:
                    await self._drained.wait()
                finally:
                    self._drained = None
                    scheduler.admitting = True
            await core.hold(Hold.PAUSE)
            self.paused = mode
            if mode == "abort":
                told = scheduler.abort_all() + core.abort_compiling()
                aborted = len(told)
                await core.tell(told)
            return {"is_paused": True, "mode": mode, "aborted": aborted}

    def check_drained(self) -> None:
        """After a step or an input: a `wait` pause ends once no started request is left."""
        if self._drained is not None and not self.core.scheduler.started_requests():
            self._drained.set()

    async def resume(self) -> dict[str, Any]:
        with self._operation("resume"):
            if self.paused is not None:
                self.paused = None
                self.core.release(Hold.PAUSE)
            return {"is_paused": False}

    def is_paused(self) -> bool:
        return self.paused is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (`Scheduler.reset_prefix_cache`); always done."""
        self.core.scheduler.reset_prefix_cache()
        return True

    # profiling

    async def start_profile(self) -> dict[str, Any]:
        if self.profiler_dir is None:
            raise OperationError(
                "unsupported", "profiling needs a directory: start the server with --profiler-dir"
            )
        with self._operation("start_profile"):
            if self.timeline.running:
                raise OperationError("conflict", "a profile is already running")
            await trio.Path(self.profiler_dir).mkdir(parents=True, exist_ok=True)
            await self._on_workers(
                "start_profile", directory=self.profiler_dir, prefix=self._prefix()
            )
            self.timeline.start()
            self.core.spawn(self._expire_profile)
            return {"profiling": True, "directory": self.profiler_dir}

    async def _expire_profile(self) -> None:
        """Stop the profile started just before, unless it was stopped first, after
        `MAX_PROFILE_SECONDS`."""
        profile = self.timeline.started
        await trio.sleep(MAX_PROFILE_SECONDS)
        while self._busy is not None:  # noqa: ASYNC110 - the call running now goes first
            await trio.sleep(1.0)
        if self.timeline.running and self.timeline.started == profile:
            log.warning(
                "a profile ran for %.0f s with no stop_profile: stopping it", MAX_PROFILE_SECONDS
            )
            try:
                await self.stop_profile()
            except Exception:
                log.exception("stopping the abandoned profile failed")

    async def stop_profile(self) -> dict[str, Any]:
        with self._operation("stop_profile"):
            if not self.timeline.running:
                raise OperationError("conflict", "no profile is running")
            assert self.profiler_dir is not None
            steps = Path(self.profiler_dir) / f"{self._prefix()}steps.json"
            try:
                results = await self._on_workers("stop_profile")
            finally:
                self.timeline.stop(steps)
            files = [f for r in results for f in r.get("files", ())]
            return {"profiling": False, "files": [*files, str(steps)]}

    def _prefix(self) -> str:
        return f"engine-{self.core.engine_index}-"

    # new weights

    async def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        if not isinstance(model_path, str) or not 0 < len(model_path) <= MAX_MODEL_PATH:
            raise OperationError(
                "invalid", f"model_path must be a path of 1 to {MAX_MODEL_PATH} characters"
            )
        with self._operation("update_weights_from_disk"):
            if self.updating:
                raise OperationError("conflict", "a weight update from a trainer is in progress")
            self.check_weight_path(model_path)
            started = time.perf_counter()
            results = await self._on_workers("update_weights_from_disk", model_path=model_path)
            self.weights_path = model_path
            self._new_version(from_source=True)
            return self._updated(started, results)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(init_info, dict):
            raise OperationError("invalid", "init_info must be an object")
        backend = init_info.get("backend")
        if backend not in ("shm", "broadcast"):
            raise OperationError("invalid", "init_info.backend must be shm or broadcast")
        with self._operation("init_weight_transfer_engine"):
            if self.updating:
                raise OperationError("conflict", "a weight update is in progress")
            offset = 1 + self.core.engine_index * self.world_size
            results = await self._on_workers(
                "init_weight_transfer", init_info=init_info, rank_offset=offset
            )
            self.transfer = backend
            return {"backend": backend, "rank_offset": offset, **memory(results)}

    async def start_weight_update(self) -> dict[str, Any]:
        with self._operation("start_weight_update"):
            if self.transfer is None:
                raise OperationError("conflict", "call /init_weight_transfer_engine first")
            if self.updating:
                raise OperationError("conflict", "a weight update is already started")
            if "weights" in self.asleep:
                raise OperationError(
                    "conflict", "the weights are asleep: wake_up with tags=weights first"
                )
            await self.core.hold(Hold.UPDATE)
            try:
                await self.core.executor.call_workers("start_weight_update")
            except BaseException:
                self.core.release(Hold.UPDATE)
                raise
            self.updating = True
            self._touched = trio.current_time()
            self.core.spawn(self._expire_update)
            return {"weight_version": self.version}

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(update_info, dict):
            raise OperationError("invalid", "update_info must be an object")
        with self._operation("update_weights"):
            if not self.updating:
                raise OperationError("conflict", "call /start_weight_update first")
            self._touched = trio.current_time()
            try:
                results = await self.core.executor.call_workers(
                    "update_weights", update_info=update_info
                )
            finally:
                if self.transfer == "shm":  # every rank is through with the buckets
                    unlink_buckets(update_info)
            return {"tensors": sum(r.get("tensors", 0) for r in results[:1]), **memory(results)}

    async def finish_weight_update(self) -> dict[str, Any]:
        with self._operation("finish_weight_update"):
            if not self.updating:
                raise OperationError("conflict", "no weight update is started")
            started = time.perf_counter()
            try:
                results = await self.core.executor.call_workers("finish_weight_update")
            finally:
                self.updating = False
                self.core.release(Hold.UPDATE)
            self._new_version(from_source=False)
            return self._updated(started, results)

    def weight_version(self) -> int:
        return self.version

    async def _expire_update(self) -> None:
        """Finish the open update once no call has come for `UPDATE_IDLE_TIMEOUT` seconds
        (counted again from the end of one that runs that long)."""
        while self.updating:
            deadline = self._touched + UPDATE_IDLE_TIMEOUT
            if trio.current_time() < deadline:
                await trio.sleep_until(deadline)
            elif self._busy is not None:
                self._touched = trio.current_time()
            else:
                log.warning(
                    "no call of the weight update for %.0f s: finishing it (the trainer left)",
                    UPDATE_IDLE_TIMEOUT,
                )
                try:
                    await self.finish_weight_update()
                except Exception:
                    log.exception("finishing the abandoned weight update failed")
                return

    def _new_version(self, *, from_source: bool) -> None:
        """New weights: every cached prefix is stale, every output says which weights."""
        self.version += 1
        self.from_source = from_source
        self.core.scheduler.weight_version = self.version
        self.core.scheduler.reset_prefix_cache()
        self.core.record_standing()

    def _updated(self, started: float, results: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "weight_version": self.version,
            "seconds": time.perf_counter() - started,
            **memory(results),
        }

    # one at a time, with no step in flight

    @contextlib.contextmanager
    def _operation(self, name: str) -> Iterator[None]:
        if self._busy is not None:
            raise OperationError("conflict", f"{self._busy} is in progress")
        self._busy = name
        try:
            yield
        finally:
            self._busy = None

    async def _on_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """`method` on every rank, the step loop held meanwhile."""
        await self.core.hold(Hold.CALL)
        try:
            return await self.core.executor.call_workers(method, **kwargs)
        finally:
            self.core.release(Hold.CALL)


def memory(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The resident memory of this process and of each rank's process (a rank in this
    process counts once), and their sum."""
    own = os.getpid()
    processes = {own: {"pid": own, "role": "engine-core", "rss_bytes": rss_bytes()}}
    for rank, result in enumerate(results):
        pid = result.get("pid")
        if pid is not None and pid != own:
            processes[pid] = {"pid": pid, "role": f"rank-{rank}", "rss_bytes": result["rss_bytes"]}
    return {
        "rss_bytes": sum(p["rss_bytes"] for p in processes.values()),
        "processes": list(processes.values()),
    }


def rss_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if isinstance(value, bool) or value not in choices:
        raise OperationError(
            "invalid", f"{name} must be one of {', '.join(map(str, choices))}, not {value!r}"
        )
    return value


def _tags(tags: Any) -> list[str]:
    if not isinstance(tags, list) or not all(t in SLEEP_TAGS for t in tags):
        raise OperationError("invalid", f"tags must be a list of {' and '.join(SLEEP_TAGS)}")
    return tags
