"""Prompts given as embeddings through a real engine core on a tiny model built here: the same
output as the prompt's token ids, and no shared-memory segment outlives its request, however
the request ends."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file
from shared_engine import engine_cores, fresh_engine, idle_stats
from shm_segments import segments

from triode.actors import EngineDeadError, RequestError, SamplingParams, open_engine
from triode.actors.launcher import EngineCoreEndpoint
from triode.wire.tensor_ipc import share

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 81, 2], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True)
def before() -> Iterator[set[str]]:
    """The segments that were there before the test; none of its own outlives it."""
    existing = segments()
    yield existing
    assert segments() <= existing


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triode.gpu.tiny_model import build_tiny_model

    # the byte-level vocabulary (259 tokens) whatever the cache holds: the prompts are ids;
    # a head of its own, since a tied one at this size repeats the prompt's last token
    return build_tiny_model(
        tmp_path_factory.mktemp("embeds") / "tiny",
        num_layers=2,
        tokenizer_from="bytes",
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def embedding(tiny_model: Path) -> torch.Tensor:
    return load_file(tiny_model / "model.safetensors")["model.embed_tokens.weight"]


def _engine_args(**extra: object) -> dict[str, object]:
    return {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256, **extra}


Cores = list[EngineCoreEndpoint]


@pytest.fixture(scope="module")
def cores(tiny_model: Path) -> Iterator[Cores]:
    """The engine of the tests that leave it as they found it, started once (`fresh_engine`
    hands each the engine idle, with every block free and the prefix cache reset); the chunked
    prefill's settings and the killed engine core are tests' own."""
    with engine_cores(str(tiny_model), **_engine_args()) as endpoints:
        yield endpoints


async def _tokens(engine: object, prompt: object, params: SamplingParams, **kw: object) -> list:
    outputs = [out async for out in engine.generate(prompt, params, **kw)]  # type: ignore[attr-defined]
    return [c.token_ids for c in outputs[-1].outputs]


async def test_embeddings_of_a_prompt_generate_what_its_token_ids_do(
    cores: Cores, embedding: torch.Tensor
) -> None:
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, n=2, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        for ids in PROMPTS:
            rows = embedding[ids]
            expected = await _tokens(engine, ids, GREEDY)
            assert await _tokens(engine, None, GREEDY, prompt_embeds=rows) == expected
            # numpy, and a second time: the prefix cache keeps embeddings apart from token ids
            assert await _tokens(engine, None, GREEDY, prompt_embeds=rows.numpy()) == expected
            # each of n children gets its own copy; seeded sampling agrees too
            by_ids = await _tokens(engine, ids, seeded)
            assert await _tokens(engine, None, seeded, prompt_embeds=rows) == by_ids
        # the long prompt's full blocks are cached by now, under its embeddings; a prompt of
        # embeddings that differs in its first block must not hit them (placeholder ids are
        # all alike, so the embeddings themselves key the cache)
        changed = list(PROMPTS[2])
        changed[3] += 1
        expected = await _tokens(engine, changed, GREEDY)
        assert expected != await _tokens(engine, PROMPTS[2], GREEDY)  # a test that can fail
        assert await _tokens(engine, None, GREEDY, prompt_embeds=embedding[changed]) == expected
        stats = await engine.get_stats()
    assert stats["num_running_reqs"] == 0


async def test_a_tensor_already_shared_is_taken_over_and_unlinked(
    cores: Cores, embedding: torch.Tensor, before: set[str]
) -> None:
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=2, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        expected = await _tokens(engine, PROMPTS[0], seeded)
        handle, _ = share(embedding[PROMPTS[0]])
        assert await _tokens(engine, None, seeded, prompt_embeds=handle) == expected
        wrong, _ = share(torch.zeros(3, embedding.shape[1] + 1))
        with pytest.raises(RequestError, match="hidden size"):
            await _tokens(engine, None, seeded, prompt_embeds=wrong)
        assert not segments() - before  # both taken over: the refused one unlinked too


async def test_a_long_prompt_of_embeddings_is_prefilled_in_chunks(
    tiny_model: Path, embedding: torch.Tensor
) -> None:
    ids = [(i * 37) % 250 + 3 for i in range(150)]
    async with open_engine(
        str(tiny_model), **_engine_args(max_num_batched_tokens=32, enable_prefix_caching=False)
    ) as engine:
        expected = await _tokens(engine, ids, GREEDY)
        assert await _tokens(engine, None, GREEDY, prompt_embeds=embedding[ids]) == expected


async def test_embeddings_the_model_cannot_take_are_refused_and_nothing_stays_shared(
    cores: Cores, embedding: torch.Tensor
) -> None:
    hidden = embedding.shape[1]
    async with fresh_engine(cores) as engine:
        for bad, why in (
            (torch.zeros(4, hidden + 1), "hidden size"),
            (torch.zeros(4, hidden, dtype=torch.float64), "dtype"),
            (torch.zeros(0, hidden), "at least one position"),
            (torch.zeros(2, 2, hidden), "positions, hidden size"),
        ):
            with pytest.raises(RequestError, match=why):
                await _tokens(engine, None, GREEDY, prompt_embeds=bad)
        with pytest.raises(RequestError, match="not both"):
            await _tokens(engine, [1, 2], GREEDY, prompt_embeds=embedding[:2])
        nan = embedding[PROMPTS[1]].clone()
        nan[1, 3] = float("nan")
        with pytest.raises(RequestError, match="not finite"):  # refused by the engine core
            await _tokens(engine, None, GREEDY, prompt_embeds=nan)
        # the engine serves on
        assert await _tokens(engine, PROMPTS[1], GREEDY)


async def test_cancelling_a_request_of_embeddings_frees_its_segment_and_blocks(
    cores: Cores, embedding: torch.Tensor, before: set[str]
) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        with trio.move_on_after(30) as scope:
            async for _ in engine.generate(None, long, prompt_embeds=embedding[PROMPTS[2]]):
                # the engine core copied the rows out and unlinked the segment on arrival
                assert not segments() - before
                scope.cancel()
        assert scope.cancelled_caught
        stats = await idle_stats(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_an_engine_core_that_dies_before_taking_the_embeddings_leaves_no_segment(
    tiny_model: Path, embedding: torch.Tensor, before: set[str]
) -> None:
    async with open_engine(str(tiny_model), **_engine_args()) as engine:
        os.kill(engine.pid, signal.SIGSTOP)  # the request waits in its socket, unread
        try:

            async def kill_once_shared() -> None:
                while not segments() - before:  # noqa: ASYNC110 - a file system poll
                    await trio.sleep(0.01)
                os.kill(engine.pid, signal.SIGKILL)

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(kill_once_shared)
                    with pytest.raises(EngineDeadError):
                        await _tokens(engine, None, GREEDY, prompt_embeds=embedding[PROMPTS[0]])
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed, and reaped
                os.kill(engine.pid, signal.SIGCONT)
    assert not segments() - before
