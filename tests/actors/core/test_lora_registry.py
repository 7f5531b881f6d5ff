"""The engine core's LoRA adapters on a stand-in for the ranks that answers `add_lora` and
`remove_lora` as the shared design says a rank does, and checks each step like a runner would
(an adapter not resident is a KeyError there, more than max_loras in a step a ValueError): the
UTILITY methods and their refusals, requests that name adapters, residency, unloading while in
use, and a reload whose files changed. Virtual time."""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio

from triode.actors.config import LoRAModule
from triode.actors.core.engine_core import EngineCore
from triode.actors.core.loras import LoRASettings
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.actors.core.utilities import call_utility
from triode.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    OperationError,
    SamplingParams,
    UtilityCall,
)
from triode.wire.step import ModelRunnerOutput, RequestStepResult, SchedulerOutput

CONFIG = SchedulerConfig(num_blocks=256, block_size=4, max_model_len=512)


class Ranks:
    """`world` ranks in this process: adapter files are `files` (real path -> digest); each
    rank keeps at most `max_cpu_loras` adapters; steps answer token 1 after 10 ms."""

    max_concurrent_batches = 1
    protocol_errors = 0
    vocab_size = 100
    hidden_size = 8

    def __init__(self, *, max_loras: int = 1, max_cpu_loras: int = 1, world: int = 1) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.world = world
        self.files: dict[str, str] = {}
        self.resident: dict[int, str] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.known: dict[str, int] = {}  # request id -> lora id, as the runner keeps it
        self.step_adapters: list[set[int]] = []
        self.step_requests: list[set[str]] = []
        self.rank1_digest: str | None = None  # what rank 1 reads, when it differs
        self.in_call = False

    def adapter(self, directory: Path, content: str) -> str:
        """An adapter directory with `content` (its digest is that of the content): its real
        path, which the ranks are given."""
        directory.mkdir(exist_ok=True)
        real = os.path.realpath(directory)
        self.files[real] = hashlib.sha256(content.encode()).hexdigest()
        return real

    async def execute(self, out: SchedulerOutput, fill_bitmask: Any) -> ModelRunnerOutput:
        assert not self.in_call, "a step while a call is on the ranks"
        for request_id in out.finished_request_ids:
            self.known.pop(request_id, None)
        adapters = set()
        for entry in out.requests:
            if entry.new is not None:
                self.known[entry.request_id] = entry.new.lora_id
            lora_id = self.known[entry.request_id]
            if lora_id:
                if lora_id not in self.resident:
                    raise KeyError(f"LoRA id {lora_id} is not resident")
                adapters.add(lora_id)
        if len(adapters) > self.max_loras:
            raise ValueError(f"{len(adapters)} adapters in one step")
        self.step_adapters.append(adapters)
        self.step_requests.append({r.request_id for r in out.requests})
        await trio.sleep(0.01)
        return ModelRunnerOutput(
            out.step, [RequestStepResult(r.request_id, token_id=1) for r in out.requests]
        )

    async def call_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        assert not self.in_call, "two calls on the ranks at once"
        self.in_call = True
        try:
            await trio.sleep(0.001)
            self.calls.append((method, kwargs))
            if method == "add_lora":
                return [self._add(rank, **kwargs) for rank in range(self.world)]
            if method == "remove_lora":
                for lora_id in kwargs["lora_ids"]:
                    self.resident.pop(lora_id, None)
                return [{"resident": len(self.resident)}] * self.world
            return [{"pid": os.getpid(), "rss_bytes": 0}] * self.world
        finally:
            self.in_call = False

    def _add(self, rank: int, lora_id: int, path: str, digest: str | None = None) -> dict:
        found = self.files.get(path)
        if found is None:
            raise OperationError("invalid", f"{path}: no adapter_config.json")
        if digest is not None and digest != found:
            raise OperationError("invalid", f"{path}: changed on disk")
        if rank == 0 and len(self.resident) >= self.max_cpu_loras:
            raise OperationError("conflict", "max_cpu_loras adapters are resident")
        if rank == 1 and self.rank1_digest is not None:
            found = self.rank1_digest
        self.resident[lora_id] = found
        return {"digest": found, "rank": 8, "targets": ["q_proj", "v_proj"], "bytes": 1000}

    def loads(self) -> list[int]:
        return [kw["lora_id"] for method, kw in self.calls if method == "add_lora"]

    def removals(self) -> list[list[int]]:
        return [kw["lora_ids"] for method, kw in self.calls if method == "remove_lora"]


class Harness:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.outputs: defaultdict[str, list[Any]] = defaultdict(list)
        self.answers: dict[int, Any] = {}

    async def collect(self) -> None:
        async for _, outputs in self.core._publisher_inbox:
            assert isinstance(outputs, EngineCoreOutputs)
            for output in outputs.outputs:
                self.outputs[output.request_id].append(output)
            if outputs.utility_output is not None:
                self.answers[outputs.utility_output.call_id] = outputs.utility_output

    async def add(self, request_id: str, lora_name: str | None, max_tokens: int = 8) -> None:
        request = EngineCoreRequest(
            request_id,
            list(range(1, 11)),
            SamplingParams(max_tokens=max_tokens),
            lora_name=lora_name,
        )
        await self.core._add(request)
        self.core._work.set()

    def finish(self, request_id: str) -> tuple[FinishReason | None, Any, int]:
        """The request's finish reason, stop reason and number of tokens."""
        outputs = self.outputs[request_id]
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if not outputs:
            return None, None, 0
        return outputs[-1].finish_reason, outputs[-1].stop_reason, tokens


async def _open(nursery: trio.Nursery, ranks: Ranks, tmp_path: Path, **settings: Any) -> Harness:
    settings.setdefault("enabled", True)
    settings.setdefault("max_loras", ranks.max_loras)
    settings.setdefault("max_cpu_loras", ranks.max_cpu_loras)
    settings.setdefault("allowed_paths", (str(tmp_path),))
    core = EngineCore(Scheduler(CONFIG), ranks, lora=LoRASettings(**settings))  # type: ignore[arg-type]
    core._nursery = nursery
    harness = Harness(core)
    nursery.start_soon(harness.collect)
    nursery.start_soon(core._step_loop)
    return harness


async def _refused(call: Any, kind: str) -> str:
    with pytest.raises(OperationError) as refused:
        await call
    assert refused.value.kind == kind, refused.value.message
    return refused.value.message


async def test_lora_utilities_register_list_and_refuse(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_cpu_loras=4)
    a = ranks.adapter(tmp_path / "a", "A")
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    module = ranks.adapter(tmp_path.parent / f"{tmp_path.name}-module", "M")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path, modules=(LoRAModule("m", module),))
        loras = h.core.loras
        added = await loras.add_lora("a", a)
        assert added == {
            "name": "a",
            "path": a,
            "lora_id": 1,
            "digest": ranks.files[a],
            "rank": 8,
            "base_model_name": None,
        }
        assert "already been loaded" in await _refused(loras.add_lora("a", a), "invalid")
        assert "--allowed-lora-paths" in await _refused(
            loras.add_lora("b", str(outside)), "invalid"
        )
        # a --lora-modules path is allowed, under any name
        assert (await loras.add_lora("m2", module))["digest"] == ranks.files[module]
        await loras.remove_lora("m2")
        # a symbolic link inside the allowed directory that leads out of it is no way out
        (tmp_path / "link").symlink_to(outside)
        assert "--allowed-lora-paths" in await _refused(
            loras.add_lora("b", str(tmp_path / "link")), "invalid"
        )
        for bad in ("", "has space", "x" * 257, "tab\t", 7):
            await _refused(loras.add_lora(bad, a), "invalid")  # type: ignore[arg-type]
        # the ranks' refusal is the answer; nothing stays registered or resident
        missing = str(tmp_path / "missing")
        assert "no adapter_config.json" in await _refused(loras.add_lora("m", missing), "invalid")
        assert [e["name"] for e in loras.list_loras()] == ["a"]
        assert await _refused(loras.remove_lora("nope"), "not_found") == (
            "The lora adapter 'nope' cannot be found."
        )
        replaced = await loras.add_lora("a", a, load_inplace=True)
        assert replaced["lora_id"] == 4  # ids are never used again (3 went to the failed one)
        assert sorted(ranks.resident) == [4]  # the replaced one was idle: it left at once
        assert (await loras.remove_lora("a"))["lora_id"] == 4
        assert loras.list_loras() == [] and not ranks.resident
        # through the UTILITY door, as a client calls it
        await call_utility(h.core, UtilityCall(5, "add_lora", ["a", a]))
        await trio.sleep(1)  # a task of its own: its answer may come after later calls'
        await call_utility(h.core, UtilityCall(6, "list_loras", []))
        await trio.sleep(0.01)
        assert h.answers[5].failure_message is None and h.answers[5].result["lora_id"] == 5
        assert [e["name"] for e in h.answers[6].result] == ["a"]
        assert h.core.get_stats()["lora_loads"] == 4
        nursery.cancel_scope.cancel()


async def test_lora_disabled_is_unsupported_and_unknown_names_fail_requests(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks()
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path, enabled=False)
        message = await _refused(h.core.loras.add_lora("a", str(tmp_path)), "unsupported")
        assert "--enable-lora" in message
        assert h.core.loras.list_loras() == []
        await h.add("r", "x")
        await h.add("base", None)
        await trio.sleep(1)
        assert h.finish("r") == (FinishReason.ERROR, "the LoRA adapter 'x' is not loaded", 0)
        assert h.finish("base")[0] is FinishReason.LENGTH
        nursery.cancel_scope.cancel()


async def test_lora_requests_run_with_their_adapter_and_outlive_its_unloading(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_cpu_loras=2)
    a = ranks.adapter(tmp_path / "a", "A")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        await h.core.loras.add_lora("a", a)
        await h.add("r", "a", max_tokens=40)
        await trio.sleep(0.1)
        entry = h.core.scheduler.requests["r"].lora
        assert entry is not None and entry.users == 1 and ranks.known["r"] == 1
        await h.core.loras.remove_lora("a")
        await h.add("late", "a")
        await trio.sleep(0.05)
        assert h.finish("late")[:2] == (FinishReason.ERROR, "the LoRA adapter 'a' is not loaded")
        assert ranks.resident == {1: ranks.files[a]}  # r still uses it
        await trio.sleep(2)
        assert h.finish("r") == (FinishReason.LENGTH, None, 40)
        assert ranks.removals() == [[1]] and not ranks.resident
        assert entry.users == 0 and not h.core.loras.retired
        nursery.cancel_scope.cancel()


async def test_lora_reloaded_in_place_serves_new_requests_while_old_ones_finish(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_loras=2, max_cpu_loras=2)
    a = ranks.adapter(tmp_path / "a", "A")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        await h.core.loras.add_lora("a", a)
        await h.add("old", "a", max_tokens=100)
        await trio.sleep(0.05)
        ranks.adapter(tmp_path / "a", "A, trained more")
        new = await h.core.loras.add_lora("a", a, load_inplace=True)
        assert new["lora_id"] == 2 and new["digest"] != h.core.loras.retired[1].digest
        await h.add("new", "a", max_tokens=4)
        await trio.sleep(0.2)
        assert h.finish("new")[0] is FinishReason.LENGTH and {1, 2} in ranks.step_adapters
        assert h.finish("old")[0] is None and 1 in ranks.resident  # it runs on the first
        await trio.sleep(2)
        assert h.finish("old") == (FinishReason.LENGTH, None, 100)
        assert ranks.removals() == [[1]] and list(ranks.resident) == [2]
        nursery.cancel_scope.cancel()


async def test_lora_not_resident_waits_for_its_load_and_evicts_the_least_recently_used(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_loras=1, max_cpu_loras=1)
    a = ranks.adapter(tmp_path / "a", "A")
    b = ranks.adapter(tmp_path / "b", "B")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        await h.core.loras.add_lora("a", a)
        await h.core.loras.add_lora("b", b)  # a was idle: it made room
        assert list(ranks.resident) == [2] and ranks.removals() == [[1]]
        await h.add("ra", "a")
        await h.add("base", None)
        await trio.sleep(1)
        assert h.finish("ra") == (FinishReason.LENGTH, None, 8)
        assert h.finish("base") == (FinishReason.LENGTH, None, 8)
        # a came back under its id, checked against the digest it was registered with
        assert ranks.calls[-1] == (
            "add_lora",
            {"lora_id": 1, "path": a, "digest": ranks.files[a]},
        )
        assert ranks.removals() == [[1], [2]]
        assert h.core.get_stats()["lora_evictions"] == 2
        nursery.cancel_scope.cancel()


async def test_lora_reload_of_changed_files_fails_its_waiting_requests(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_loras=1, max_cpu_loras=1)
    a = ranks.adapter(tmp_path / "a", "A")
    b = ranks.adapter(tmp_path / "b", "B")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        await h.core.loras.add_lora("a", a)
        await h.core.loras.add_lora("b", b)
        ranks.adapter(tmp_path / "a", "A, overwritten")
        await h.add("ra", "a")
        await h.add("ra2", "a")
        await h.add("rb", "b")
        await trio.sleep(1)
        for request_id in ("ra", "ra2"):
            reason, message, tokens = h.finish(request_id)
            assert reason is FinishReason.ERROR and tokens == 0
            assert "could not be loaded" in message and "changed on disk" in message
        assert h.finish("rb") == (FinishReason.LENGTH, None, 8)
        assert not h.core.scheduler.requests and not h.core.holds
        nursery.cancel_scope.cancel()


async def test_lora_at_most_max_loras_adapters_a_step_and_base_requests_pass(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_loras=1, max_cpu_loras=2)
    a = ranks.adapter(tmp_path / "a", "A")
    b = ranks.adapter(tmp_path / "b", "B")
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        await h.core.loras.add_lora("a", a)
        await h.core.loras.add_lora("b", b)
        await h.add("ra", "a", max_tokens=6)
        await h.add("rb", "b", max_tokens=6)
        await h.add("base", None, max_tokens=6)
        await trio.sleep(1)
        for request_id in ("ra", "rb", "base"):
            assert h.finish(request_id) == (FinishReason.LENGTH, None, 6)
        assert all(len(step) <= 1 for step in ranks.step_adapters)
        # rb waited for ra to finish; the base request behind it started beside ra
        assert ranks.step_requests[0] == {"ra", "base"}
        first_b = next(i for i, s in enumerate(ranks.step_requests) if "rb" in s)
        assert all("ra" not in s for s in ranks.step_requests[first_b:])
        nursery.cancel_scope.cancel()


async def test_lora_ranks_that_read_different_files_are_refused(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ranks = Ranks(max_cpu_loras=2, world=2)
    a = ranks.adapter(tmp_path / "a", "A")
    ranks.rank1_digest = "0" * 64
    async with trio.open_nursery() as nursery:
        h = await _open(nursery, ranks, tmp_path)
        assert "different files" in await _refused(h.core.loras.add_lora("a", a), "invalid")
        assert ranks.removals() == [[1]] and not ranks.resident
        assert h.core.loras.list_loras() == []
        nursery.cancel_scope.cancel()


async def test_lora_modules_load_before_the_engine_runs_or_fail_its_start(
    tmp_path: Path,
) -> None:
    ranks = Ranks(max_cpu_loras=1)
    a = ranks.adapter(tmp_path / "a", "A")
    b = ranks.adapter(tmp_path / "b", "B")
    modules = (LoRAModule("a", a), LoRAModule("b", b, "base-model"))
    core = EngineCore(  # type: ignore[arg-type]
        Scheduler(CONFIG),
        ranks,
        lora=LoRASettings(enabled=True, max_cpu_loras=1, modules=modules),
    )
    await core.loras.load_modules()
    assert [(e["name"], e["base_model_name"]) for e in core.loras.list_loras()] == [
        ("a", None),
        ("b", "base-model"),
    ]
    assert list(ranks.resident) == [2]  # one fits: the other loads when asked for

    broken = EngineCore(  # type: ignore[arg-type]
        Scheduler(CONFIG),
        Ranks(),
        lora=LoRASettings(enabled=True, modules=(LoRAModule("gone", str(tmp_path / "gone")),)),
    )
    with pytest.raises(RuntimeError, match=r"--lora-modules gone=.*no adapter_config\.json"):
        await broken.loras.load_modules()
