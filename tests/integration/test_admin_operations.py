"""The administrative operations end to end through `Engine.admin`: real engine-core processes
(and worker processes for TP and PP), the default model and tiny random ones, fp32 where outputs
are compared."""

from __future__ import annotations

import json
import shutil
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
from engine_calls import final_output, waiting
from safetensors.torch import load_file, save_file

from triode.actors import OperationError, SamplingParams, open_engine
from triode.gpu.gguf_file import packed_weights
from triode.gpu.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MiB = 1 << 20


async def _generate(engine, prompt, params=GREEDY):  # type: ignore[no-untyped-def]
    return await final_output(engine, prompt, params)


async def _tokens(engine, prompts):  # type: ignore[no-untyped-def]
    return [(await _generate(engine, p)).outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, intermediate_size=256, seed=3
    )


def perturbed(model: Path, out: Path, scale: float = 1.5) -> Path:
    """A copy of `model` whose weights all differ (same architecture and shapes)."""
    shutil.copytree(model, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({n: (t * scale).contiguous() for n, t in tensors.items()}, path)
    return out


async def test_sleep_gives_the_kv_cache_and_weights_back_and_wakes_the_same(
    model_dir: Path,
) -> None:
    """The default model: level 1 gives back at least the KV cache's memory, level 2 also the
    weights'; a request sent while asleep runs after the wake; the prefix cache is empty after
    each wake, and greedy outputs are the same throughout."""
    prompt = [1, *range(200, 260)]
    kv = 256 * MiB
    async with open_engine(
        str(model_dir), dtype="float32", kv_cache_memory=kv, max_model_len=2048
    ) as engine:
        admin = engine.admin
        before = (await _generate(engine, prompt)).outputs[0].token_ids
        assert (await _generate(engine, prompt)).num_cached_tokens > 0
        awake = await admin.memory()

        asleep = await admin.sleep(level=1)
        assert asleep["is_sleeping"] and asleep["asleep"] == ["kv_cache"]
        assert awake["rss_bytes"] - asleep["rss_bytes"] >= 0.9 * kv
        with pytest.raises(OperationError) as refused:
            await admin.sleep(level=1)
        assert refused.value.kind == "conflict"

        results = []

        async def late() -> None:
            results.append(await _generate(engine, prompt))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late)
            await waiting(engine)
            assert not results  # asleep: it waits, not refused
            woke = await admin.wake_up()
        assert not woke["is_sleeping"]
        assert results[0].outputs[0].token_ids == before
        assert results[0].num_cached_tokens == 0  # the prefix cache went with the memory

        # the dense file's and the GGUF file's weights, which are read where they lie
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))  # noqa: ASYNC240
        weights += sum(w.nbytes for _, w in packed_weights(model_dir))
        awake = await admin.memory()
        asleep = await admin.sleep(level=2)
        assert asleep["asleep"] == ["kv_cache", "weights"]
        assert awake["rss_bytes"] - asleep["rss_bytes"] >= 0.9 * (kv + weights)
        half = await admin.wake_up(tags=["weights"])
        assert half["is_sleeping"] and half["asleep"] == ["kv_cache"]
        await admin.wake_up()
        again = await _generate(engine, prompt)
        assert again.outputs[0].token_ids == before and again.num_cached_tokens == 0
        assert await admin.weight_version() == 0


async def test_sleep_wake_and_profile_on_every_rank(tiny: Path, tmp_path: Path) -> None:
    """Tensor x pipeline parallel 2 x 2: every rank gives its memory back and takes it again
    (greedy outputs unchanged), and each writes its profile beside the step timeline."""
    prompts = [[1, *range(30, 50)], [1, *range(70, 75)]]
    kv = 64 * MiB
    directory = tmp_path / "profiles"
    async with open_engine(
        str(tiny),
        dtype="float32",
        kv_cache_memory=kv,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        profiler_dir=str(directory),
    ) as engine:
        before = await _tokens(engine, prompts)
        awake = await engine.admin.memory()
        asleep = await engine.admin.sleep(level=2)
        ranks = [p for p in asleep["processes"] if p["role"].startswith("rank-")]
        assert len(ranks) == 4
        # each rank holds its share of a cache of `kv` bytes
        assert awake["rss_bytes"] - asleep["rss_bytes"] >= 0.9 * kv
        await engine.admin.wake_up()
        assert await _tokens(engine, prompts) == before

        with pytest.raises(OperationError) as refused:
            await engine.admin.stop_profile()
        assert refused.value.kind == "conflict"
        await engine.admin.start_profile()
        await _generate(engine, [1, *range(5, 40)])
        done = await engine.admin.stop_profile()
    files = [Path(f) for f in done["files"]]
    assert sorted(f.name for f in files) == [
        *(f"engine-0-rank-{r}.json" for r in range(4)), "engine-0-steps.json",
    ]  # fmt: skip
    for path in files:
        assert json.loads(path.read_text())["traceEvents"]
    steps = json.loads((directory / "engine-0-steps.json").read_text())["traceEvents"]
    assert sum(e["args"]["tokens"] for e in steps) >= 35 + 11
    rank0 = json.loads((directory / "engine-0-rank-0.json").read_text())["traceEvents"]
    assert any(e.get("name") in ("aten::mm", "aten::linear", "aten::addmm") for e in rank0)


class Seen(list):  # type: ignore[type-arg]
    """A request's outputs as they come, and an event set by the first."""

    def __init__(self) -> None:
        super().__init__()
        self.first = trio.Event()


async def _stream(engine, prompt, params, seen):  # type: ignore[no-untyped-def]
    """Generate, noting each output in `seen`."""
    async with aclosing(engine.generate(prompt, params)) as outputs:
        async for out in outputs:
            seen.append(out)
            seen.first.set()


async def test_pause_abort_wait_and_keep_with_requests_in_flight(tiny: Path) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = [1, *range(10, 20)]
    async with open_engine(str(tiny), dtype="float32") as engine:
        admin = engine.admin
        reference = (await _generate(engine, prompt, long)).outputs[0].token_ids

        # abort: the stream ends at once, cleanly, with finish reason "abort"
        seen = Seen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, engine, prompt, long, seen)
            await seen.first.wait()
            paused = await admin.pause(mode="abort")
        assert paused["aborted"] == 1 and await admin.is_paused()
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        assert len(seen[-1].outputs[0].token_ids) < 200
        # a request sent while paused waits, and runs after the resume
        results = Seen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _stream(engine, prompt, GREEDY, results))
            await waiting(engine)
            assert not results
            await admin.resume()
        assert results[-1].outputs[0].token_ids == reference[:12]

        # keep: frozen with its KV, then continued to the same tokens
        seen = Seen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, engine, prompt, long, seen)
            await seen.first.wait()
            await admin.pause(mode="keep")
            steps = (await engine.get_stats())["steps"]
            await trio.sleep(0.3)
            assert (await engine.get_stats())["steps"] == steps  # frozen: no step taken
            assert not seen[-1].finished
            await admin.resume()
        assert seen[-1].outputs[0].token_ids == reference
        assert seen[-1].outputs[0].finish_reason == "length"

        # wait: the started request finishes; one that had not started waits for the resume
        seen, queued = Seen(), Seen()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, engine, prompt, long, seen)
            await seen.first.wait()
            with trio.fail_after(60):
                async with trio.open_nursery() as pausing:
                    pausing.start_soon(admin.pause, "wait")
                    await trio.sleep(0.05)
                    nursery.start_soon(lambda: _stream(engine, prompt, GREEDY, queued))
            assert seen[-1].finished and seen[-1].outputs[0].token_ids == reference
            await waiting(engine)
            assert not queued
            await admin.resume()
        assert queued[-1].outputs[0].token_ids == reference[:12]
        stats = await engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_update_weights_from_disk_serves_the_new_weights(tiny: Path, tmp_path: Path) -> None:
    # the engine may read new weights under `allowed` only (or from its own directory)
    allowed = tmp_path / "checkpoints"
    allowed.mkdir()
    changed = perturbed(tiny, allowed / "changed")
    prompts = [[1, *range(30, 50)], [1, *range(70, 75)]]
    async with open_engine(str(changed), dtype="float32") as fresh:
        expected = await _tokens(fresh, prompts)
    # two data-parallel engine cores: each takes every operation
    outside = perturbed(tiny, tmp_path / "outside")
    (allowed / "escape").symlink_to(outside)
    async with open_engine(
        str(tiny), dtype="float32", data_parallel_size=2, allowed_weight_paths=[str(allowed)]
    ) as engine:
        old = await _tokens(engine, prompts * 2)
        assert old[:2] == old[2:] and old[:2] != expected
        assert (await _generate(engine, prompts[0])).num_cached_tokens > 0

        wrong = build_tiny_model(allowed / "wrong", hidden_size=64)
        for path, why in (
            (wrong, "hidden_size is 64"),
            (allowed / "nowhere", ""),
            (outside, "--allowed-weight-paths"),
            (allowed / "escape", "--allowed-weight-paths"),  # a link out of the allowed ones
        ):
            with pytest.raises(OperationError) as refused:
                await engine.admin.update_weights_from_disk(str(path))
            assert refused.value.kind == "invalid" and why in str(refused.value)
        assert await _tokens(engine, prompts * 2) == old  # still the old weights
        assert await engine.admin.weight_version() == 0

        updated = await engine.admin.update_weights_from_disk(str(changed))
        assert [e["weight_version"] for e in updated["engines"]] == [1, 1]
        out = await _generate(engine, prompts[0])
        assert out.num_cached_tokens == 0 and out.weight_version == 1
        assert await _tokens(engine, prompts * 2) == expected * 2
        # a level 2 sleep reloads the weights from the checkpoint given last
        slept = await engine.admin.sleep(level=2)
        assert len(slept["engines"]) == 2
        await engine.admin.wake_up()
        assert await _tokens(engine, prompts * 2) == expected * 2
        assert await engine.admin.weight_version() == 1
