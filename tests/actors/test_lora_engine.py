"""LoRA adapters through a real engine (`open_engine`, the model in the engine core) on a tiny
random model with random PEFT adapters: served from the start and loaded at run time, greedy
outputs that the adapter changes and the registry's name does not, the prefix cache keyed by
the adapter's content, unloading, refusals, a start that fails on a bad adapter, and a recording
that replays, and a restarted engine core that serves the same adapters and weights."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from triode.actors import (
    EngineRestarting,
    OperationError,
    RequestError,
    SamplingParams,
    open_engine,
    replay,
)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 42, 9, 100, 3, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-engine")


@pytest.fixture(scope="module")
def tiny(root: Path) -> Path:
    from triode.gpu.tiny_model import build_tiny_model

    return build_tiny_model(root / "tiny", num_layers=2)


@pytest.fixture(scope="module")
def adapters(root: Path, tiny: Path) -> dict[str, Path]:
    """Two random adapters made with peft, under root/adapters (the allowed directory)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = {}
    for seed, name in enumerate(("a", "b")):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        config = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(std=0.5)
        model.save_pretrained(root / "adapters" / name)
        made[name] = root / "adapters" / name
    return made


def _args(root: Path, adapters: dict[str, Path], **extra: object) -> dict[str, object]:
    return {
        "dtype": "float32",
        "kv_cache_memory": "16MiB",
        "max_model_len": 256,
        "enable_lora": True,
        "lora_modules": [f"a={adapters['a']}"],
        "max_loras": 2,
        "max_cpu_loras": 2,
        "allowed_lora_paths": [str(root / "adapters")],
        **extra,
    }


async def _run(engine: object, lora_name: str | None) -> tuple[list[int], int]:
    """The greedy tokens for PROMPT and the prefix-cache hit."""
    outputs = [o async for o in engine.generate(PROMPT, GREEDY, lora_name=lora_name)]  # type: ignore[attr-defined]
    return outputs[-1].outputs[0].token_ids, outputs[-1].num_cached_tokens


async def test_lora_adapters_through_the_engine(root: Path, adapters: dict[str, Path]) -> None:
    async with open_engine(str(root / "tiny"), **_args(root, adapters)) as engine:
        [listed] = await engine.list_loras()
        assert listed["name"] == "a" and listed["lora_id"] == 1 and listed["rank"] == 8
        assert len(listed["digest"]) == 64

        base, base_hit = await _run(engine, None)
        with_a, a_hit = await _run(engine, "a")
        assert with_a != base  # the adapter does something
        assert base_hit == 0 and a_hit == 0  # the base model's blocks are not a's
        again, hit = await _run(engine, "a")
        assert again == with_a and hit > 0

        loaded = await engine.admin.load_lora_adapter("b", str(adapters["b"]))
        assert loaded["lora_id"] == 2 and loaded["digest"] != listed["digest"]
        with_b, b_hit = await _run(engine, "b")
        assert with_b not in (base, with_a) and b_hit == 0

        # "b" again, now with a's files: a's outputs, and a's cached blocks (by content)
        replaced = await engine.admin.load_lora_adapter("b", str(adapters["a"]), True)
        assert replaced["digest"] == listed["digest"] and replaced["lora_id"] == 3
        assert await _run(engine, "b") == (with_a, hit)

        with pytest.raises(OperationError) as refused:
            await engine.admin.load_lora_adapter("b", str(adapters["a"]))
        assert refused.value.kind == "invalid" and "already been loaded" in refused.value.message
        with pytest.raises(OperationError) as refused:
            await engine.admin.load_lora_adapter("c", str(root / "tiny"))
        assert "--allowed-lora-paths" in refused.value.message
        broken = root / "adapters" / "broken"
        broken.mkdir()
        with pytest.raises(OperationError) as refused:
            await engine.admin.load_lora_adapter("c", str(broken))
        assert refused.value.kind == "invalid"  # the rank's word on a directory with no adapter

        assert (await engine.admin.unload_lora_adapter("a"))["lora_id"] == 1
        with pytest.raises(RequestError, match="the LoRA adapter 'a' is not loaded"):
            await _run(engine, "a")
        with pytest.raises(OperationError) as refused:
            await engine.admin.unload_lora_adapter("a")
        assert refused.value.kind == "not_found"
        assert [e["name"] for e in await engine.list_loras()] == ["b"]
        assert await _run(engine, None) == (base, len(PROMPT) // 16 * 16)
        stats = await engine.get_stats()
        assert stats["lora_loads"] == 3 and stats["loras_resident"] == 1


async def test_lora_engine_with_a_bad_module_does_not_start(
    root: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(adapters["a"], bad)
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(BaseException) as failed:
        async with open_engine(str(root / "tiny"), **_args(root, {"a": bad})):
            pass
    assert "--lora-modules a=" in str(failed.value) or any(
        "--lora-modules a=" in str(e) for e in _leaves(failed.value)
    )


async def test_lora_requests_replay_from_a_recording(
    root: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    recording = tmp_path / "recording"
    args = _args(root, adapters, record_wire=str(recording))
    async with open_engine(str(root / "tiny"), **args) as engine:
        await engine.admin.load_lora_adapter("b", str(adapters["b"]))
        for name in (None, "a", "b", "a"):
            await _run(engine, name)
    report = await replay(recording, speed=float("inf"), max_seconds=60)
    assert report.identical == 4 and not report.differences and not report.timed_out


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


async def test_lora_across_data_parallel_engines_and_tensor_parallel_ranks(
    root: Path, adapters: dict[str, Path]
) -> None:
    """Every engine core of two takes each load and unload; two tensor-parallel ranks (worker
    processes) read the same digest and give the outputs of one."""
    async with open_engine(str(root / "tiny"), **_args(root, adapters)) as one:
        expected = await _run(one, "a")
        await one.admin.load_lora_adapter("b", str(adapters["b"]))
        expected_b = await _run(one, "b")
    async with open_engine(
        str(root / "tiny"), **_args(root, adapters, data_parallel_size=2)
    ) as engine:
        loaded = await engine.admin.load_lora_adapter("b", str(adapters["b"]))
        assert [e["lora_id"] for e in loaded["engines"]] == [2, 2]
        results = [await _run(engine, "b") for _ in range(4)]  # balanced over both
        assert {tuple(tokens) for tokens, _ in results} == {tuple(expected_b[0])}
        unloaded = await engine.admin.unload_lora_adapter("b")
        assert len(unloaded["engines"]) == 2
        for _ in range(2):
            with pytest.raises(RequestError, match="'b' is not loaded"):
                await _run(engine, "b")
    async with open_engine(
        str(root / "tiny"), **_args(root, adapters, tensor_parallel_size=2)
    ) as engine:
        assert (await _run(engine, "a"))[0] == expected[0]
        await engine.admin.load_lora_adapter("b", str(adapters["b"]))
        assert (await _run(engine, "b"))[0] == expected_b[0]


def test_lora_through_the_asyncio_bridge(root: Path, adapters: dict[str, Path]) -> None:
    from triode.actors.asyncio import open_engine as open_asyncio_engine

    async def main() -> dict[str, Any]:
        async with open_asyncio_engine(str(root / "tiny"), **_args(root, adapters)) as engine:
            loaded = await engine.load_lora_adapter("b", str(adapters["b"]))
            outputs = [o async for o in engine.generate(PROMPT, GREEDY, lora_name="b")]
            unloaded = await engine.unload_lora_adapter("a")
            return {
                "loaded": loaded,
                "tokens": outputs[-1].outputs[0].token_ids,
                "unloaded": unloaded,
                "listed": await engine.list_loras(),
            }

    seen = asyncio.run(main())
    assert seen["loaded"]["name"] == "b" and seen["unloaded"]["name"] == "a"
    assert len(seen["tokens"]) == GREEDY.max_tokens
    assert [e["name"] for e in seen["listed"]] == ["b"]


def _perturbed(model: Path, out: Path) -> Path:
    """A copy of `model` whose weights all differ (same architecture and shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({n: (t * 1.5).contiguous() for n, t in tensors.items()}, path)
    return out


async def test_a_restarted_engine_core_serves_what_the_operator_left(
    root: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """SIGKILL the engine core: the one started in its place serves the adapter loaded at run
    time (its digest checked again) and the weights of the last update from disk under the
    same weight_version, awake, with an empty prefix cache. An adapter whose files changed
    meanwhile is left out; the rest serve."""
    changed = _perturbed(root / "tiny", tmp_path / "weights" / "changed")
    copied = root / "adapters" / "restart-c"
    shutil.copytree(adapters["b"], copied)
    args = _args(
        root,
        adapters,
        allowed_weight_paths=[str(tmp_path / "weights")],
        record_wire=str(tmp_path / "wire"),
    )
    async with open_engine(str(root / "tiny"), **args) as engine:
        await engine.admin.load_lora_adapter("b", str(adapters["b"]))
        await engine.admin.load_lora_adapter("c", str(copied))
        assert (await engine.admin.update_weights_from_disk(str(changed)))["weight_version"] == 1
        before = {name: await _run(engine, name) for name in (None, "a", "b", "c")}
        digests = {e["name"]: e["digest"] for e in await engine.list_loras()}
        await engine.admin.sleep(level=1)
        shutil.copy(adapters["a"] / "adapter_model.safetensors", copied)
        dead = engine.pid
        os.kill(dead, signal.SIGKILL)
        with trio.fail_after(60):
            while True:
                try:
                    after = {name: await _run(engine, name) for name in (None, "a", "b")}
                    break
                except EngineRestarting:
                    await trio.sleep(0.1)
        assert engine.pid != dead and engine.restarts == 1
        assert {e["name"]: e["digest"] for e in await engine.list_loras()} == {
            name: digests[name] for name in ("a", "b")
        }
        assert await engine.admin.weight_version() == 1
        assert not await engine.admin.is_sleeping()
        # the same tokens, none of them from a cache that outlived its process
        assert after == {name: (before[name][0], 0) for name in (None, "a", "b")}
        with pytest.raises(RequestError, match="'c' is not loaded"):
            await _run(engine, "c")
    # the one started in its place records into a directory of its own
    assert (tmp_path / "wire" / "restart-1" / "meta.json").is_file()
