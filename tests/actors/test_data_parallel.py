"""`data_parallel_size`: several engine cores behind one `Engine`, on a tiny model built here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
from processes import alive

from triode.actors import EngineDeadError, RequestError, SamplingParams, open_engine

pytestmark = pytest.mark.slow

PROMPTS = [[5 + i, 17, 42, 9 + i, 100, 3] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triode.gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("dp") / "tiny", num_layers=2)


def _engine_args(**extra: object) -> dict[str, object]:
    return {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 1024, **extra}


async def _generate_all(engine: object, params: SamplingParams) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        async for out in engine.generate(PROMPTS[i], params):  # type: ignore[attr-defined]
            results[i] = out.outputs[0].token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return results


GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def one_engine(tiny_model: Path) -> list[list[int]]:
    """A world of one's greedy tokens for every prompt: what every layout must give."""

    async def generate() -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        async with open_engine(str(tiny_model), **_engine_args()) as one:
            return await _generate_all(one, params)

    return trio.run(generate)


async def test_two_engines_share_the_requests_and_agree_with_one(
    tiny_model: Path, one_engine: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    expected = one_engine
    async with open_engine(str(tiny_model), **_engine_args(data_parallel_size=2)) as two:
        assert len(set(two.pids)) == 2
        got = await _generate_all(two, params)
        stats = await two.get_stats()
        pids = two.pids
    assert got == expected
    per_engine = [e["prompt_tokens_computed"] for e in stats["engines"]]
    assert len(per_engine) == 2 and all(n > 0 for n in per_engine), per_engine
    assert stats["prompt_tokens_computed"] == sum(per_engine) == sum(map(len, PROMPTS))
    assert not any(alive(pid) for pid in pids)


async def test_data_parallel_combines_with_tensor_parallel(
    tiny_model: Path, one_engine: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [tokens[:8] for tokens in one_engine]  # greedy: the first 8 of the 12
    args = _engine_args(data_parallel_size=2, tensor_parallel_size=2)
    async with open_engine(str(tiny_model), **args) as engine:
        assert engine.tensor_parallel_size == 2 and engine.data_parallel_size == 2
        workers = engine.worker_pids
        assert len(set(workers)) == 4 and all(alive(pid) for pid in workers)
        got = await _generate_all(engine, params)
        stats = await engine.get_stats()
        pids = [*engine.pids, *workers]
    assert got == expected
    assert all(e["prompt_tokens_computed"] > 0 for e in stats["engines"]), stats["engines"]
    assert not any(alive(pid) for pid in pids)


async def test_a_dead_engine_fails_its_requests_and_the_other_serves_on(tiny_model: Path) -> None:
    """SIGKILL one of two engine cores: its requests fail at once, the other's finish, new
    requests go to the live one while another starts in the dead one's place, and then both
    serve."""
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    async with open_engine(str(tiny_model), **_engine_args(data_parallel_size=2)) as engine:
        outcomes: list[object] = [None] * 4
        first_tokens = trio.Semaphore(0)

        async def one(i: int) -> None:
            tokens = 0
            try:
                async for out in engine.generate(PROMPTS[i], params, delta=True):
                    if tokens == 0:
                        first_tokens.release()
                    tokens += len(out.outputs[0].token_ids)
            except EngineDeadError as e:
                outcomes[i] = e
            else:
                outcomes[i] = tokens

        dead = engine.pids[1]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
                for _ in range(4):
                    await first_tokens.acquire()
                os.kill(dead, signal.SIGKILL)
                while engine.engines_alive == 2:  # noqa: ASYNC110 - the client sees it
                    await trio.sleep(0.01)
                assert engine.dead is None  # the other one serves on
        failed = [o for o in outcomes if isinstance(o, EngineDeadError)]
        finished = [o for o in outcomes if o == 900]
        assert len(failed) == 2 and len(finished) == 2, outcomes
        short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for prompt in PROMPTS[:3]:  # every new request goes to a live engine
            outputs = [out async for out in engine.generate(prompt, short)]
            assert len(outputs[-1].outputs[0].token_ids) == 4
        with trio.fail_after(60):
            while engine.engines_alive < 2:  # noqa: ASYNC110 - another process starts
                await trio.sleep(0.05)
        assert engine.pids[1] != dead and engine.restarts == 1
        for rank in (0, 1):  # both serve again
            outputs = [
                out async for out in engine.generate(PROMPTS[0], short, data_parallel_rank=rank)
            ]
            assert len(outputs[-1].outputs[0].token_ids) == 4
        stats = await engine.get_stats()
        assert stats["num_running_reqs"] == 0 and len(stats["engines"]) == 2
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_a_request_may_ask_for_its_engine_core(tiny_model: Path) -> None:
    """`data_parallel_rank` (a router's X-data-parallel-rank) runs the request on that engine
    core; one out of range is refused."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    async with open_engine(str(tiny_model), **_engine_args(data_parallel_size=2)) as two:
        for _ in range(3):
            async for _ in two.generate(PROMPTS[0], params, data_parallel_rank=1):
                pass
        stats = await two.get_stats()
        with pytest.raises(RequestError, match="data_parallel_rank must be 0 to 1"):
            async for _ in two.generate(PROMPTS[0], params, data_parallel_rank=2):
                pass
    computed = [e["prompt_tokens_computed"] for e in stats["engines"]]
    assert computed[0] == 0 and computed[1] > 0, computed
