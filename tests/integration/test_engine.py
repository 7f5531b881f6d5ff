"""The embedding API end to end: a real engine-core process on the real default model,
checked token for token against Hugging Face transformers."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
from engine_calls import final_output, waiting
from reference import Reference
from shared_engine import engine_cores, fresh_engine, idle_stats

from triode.actors import EngineDeadError, RequestError, SamplingParams, open_engine
from triode.actors.launcher import EngineCoreEndpoint
from triode.wire import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
F32 = {"dtype": "float32"}


async def _generate(engine, prompt, params=GREEDY):  # type: ignore[no-untyped-def]
    return await final_output(engine, prompt, params)


async def _all(engine, prompts, params=GREEDY):  # type: ignore[no-untyped-def]
    results: dict[int, object] = {}

    async def one(i: int, prompt: list[int]) -> None:
        results[i] = await _generate(engine, prompt, params)

    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(prompts):
            nursery.start_soon(one, i, prompt)
    return [results[i] for i in range(len(prompts))]


Cores = list[EngineCoreEndpoint]


@pytest.fixture(scope="module")
def cores(model_dir: Path) -> Iterator[Cores]:
    """The float32 engine of the tests that leave it as they found it, started once: each test
    connects to it afresh (`fresh_engine`: idle, awake, no block held, prefix cache empty). The
    tests of other settings, and the one that kills its engine, start their own."""
    with engine_cores(str(model_dir), **F32) as endpoints:
        yield endpoints


def _prompts(reference: Reference) -> list[list[int]]:
    return [reference.encode(p) for p in PROMPTS[:3]] + [reference.chat(PROMPTS[3])]


async def test_greedy_matches_transformers_alone_and_batched(
    cores: Cores, reference: Reference
) -> None:
    prompts = _prompts(reference)
    expected = [reference.greedy(tuple(p), NEW_TOKENS) for p in prompts]
    async with fresh_engine(cores) as engine:
        alone = [await _generate(engine, p) for p in prompts]
        batched = await _all(engine, prompts)
        stats = await idle_stats(engine)
    assert [o.outputs[0].token_ids for o in alone] == expected
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert alone[0].outputs[0].text == reference.tokenizer.decode(expected[0])
    assert alone[0].outputs[0].finish_reason == "length"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_greedy_matches_with_chunked_prefill(model_dir: Path, reference: Reference) -> None:
    prompts = _prompts(reference)
    expected = [reference.greedy(tuple(p), NEW_TOKENS) for p in prompts]
    async with open_engine(str(model_dir), max_num_batched_tokens=8, **F32) as engine:
        batched = await _all(engine, prompts)
    assert [o.outputs[0].token_ids for o in batched] == expected


async def test_greedy_matches_under_preemption(model_dir: Path, reference: Reference) -> None:
    prompts = _prompts(reference)
    expected = [reference.greedy(tuple(p), NEW_TOKENS) for p in prompts]
    # Room for ~7 blocks of 16 tokens: each request alone fits, all four together do not.
    async with open_engine(
        str(model_dir), kv_cache_memory=5_200_000, max_model_len=112, **F32
    ) as engine:
        assert engine.num_kv_blocks * engine.block_size < sum(len(p) + NEW_TOKENS for p in prompts)
        batched = await _all(engine, prompts)
        stats = await idle_stats(engine)
    assert [o.outputs[0].token_ids for o in batched] == expected
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_shared_prefix_hits_the_prefix_cache(cores: Cores, reference: Reference) -> None:
    system = "You are a helpful assistant who answers questions about geography briefly. " * 3
    first, second = (
        reference.encode(system + "Where is Peru?"),
        reference.encode(system + "Where is Chad?"),
    )
    async with fresh_engine(cores) as engine:
        one = await _generate(engine, first)
        two = await _generate(engine, second)
        # a salt starts a chain of its own: only the same salt shares, and answers the same
        salted = [await _salted(engine, second, salt) for salt in ("a", "a", "b")]
        with pytest.raises(RequestError, match="cache_salt"):
            await _salted(engine, second, "")
    assert one.num_cached_tokens == 0
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert two.num_cached_tokens == shared // 16 * 16 > 0
    assert two.outputs[0].token_ids == reference.greedy(tuple(second), NEW_TOKENS)
    whole = (len(second) - 1) // 16 * 16
    assert [out.num_cached_tokens for out in salted] == [0, whole, 0]
    assert all(out.outputs[0].token_ids == two.outputs[0].token_ids for out in salted)


async def _salted(engine, prompt, salt):  # type: ignore[no-untyped-def]
    final = None
    async for out in engine.generate(prompt, GREEDY, cache_salt=salt):
        final = out
    return final


async def test_sampling_seeds_top_k_and_logprobs(cores: Cores, reference: Reference) -> None:
    prompt = reference.encode(PROMPTS[0])
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        a = await _generate(engine, prompt, seeded)
        b = await _generate(engine, prompt, seeded)
        top1 = await _generate(
            engine,
            prompt,
            SamplingParams(temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        lp = await _generate(
            engine, prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
        )
        two = await _generate(
            engine,
            prompt,
            SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert top1.outputs[0].token_ids == reference.greedy(tuple(prompt), NEW_TOKENS)
    generated = lp.outputs[0].token_ids
    ref = reference.log_softmax(prompt + generated)
    for i, entry in enumerate(lp.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == generated[i]
        assert math.isclose(entry.logprob, row[generated[i]].item(), abs_tol=1e-3)
        assert entry.rank == 1  # greedy picks the most likely token
        assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
    assert len(two.outputs) == 2 and all(len(o.token_ids) == 8 for o in two.outputs)


async def test_stop_strings_and_too_long_prompts(model_dir: Path, reference: Reference) -> None:
    prompt = reference.encode(PROMPTS[0])
    full = reference.tokenizer.decode(reference.greedy(tuple(prompt), NEW_TOKENS))
    stop = full.strip().split()[1]  # the second word of the greedy continuation
    async with open_engine(str(model_dir), max_model_len=64, **F32) as engine:
        out = await _generate(
            engine, prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop])
        )
        with pytest.raises(RequestError, match="at most 63"):
            await _generate(engine, list(range(100, 200)))
        stats = await idle_stats(engine)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == full[: full.index(stop)]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _with_generation_config(model_dir: Path, out: Path, config: dict) -> None:
    for entry in model_dir.iterdir():
        (out / entry.name).symlink_to(entry)
    (out / "generation_config.json").write_text(json.dumps(config))


async def test_every_eos_id_of_generation_config_ends_a_sequence(
    model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    # the model again, with generation_config.json listing a second EOS: the token it greedily
    # generates third (Llama 3 lists its end-of-turn token this way)
    prompt = reference.encode(PROMPTS[0])
    expected = reference.greedy(tuple(prompt), NEW_TOKENS)
    third = expected[2]
    assert third not in expected[:2]
    eos = reference.tokenizer.eos_token_id
    _with_generation_config(model_dir, tmp_path, {"eos_token_id": [eos, third]})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    async with open_engine(str(tmp_path), **F32) as engine:
        stopped = await _generate(engine, prompt, params)
        ignored = await _generate(engine, prompt, GREEDY)
    assert engine.eos_token_id == eos
    assert stopped.outputs[0].token_ids == expected[:3]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == third
    assert ignored.outputs[0].token_ids == expected


async def test_cancel_mid_stream_frees_every_block(cores: Cores, reference: Reference) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        seen = 0
        with trio.move_on_after(30) as scope:
            async for out in engine.generate(reference.encode(PROMPTS[1]), long):
                seen = len(out.outputs[0].token_ids)
                if seen >= 5:
                    scope.cancel()
        assert scope.cancelled_caught and 5 <= seen < 400
        stats = await idle_stats(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        # Leaving an aclosing() block early (break) aborts too.
        async with aclosing(engine.generate(reference.encode(PROMPTS[2]), long)) as outs:
            async for _ in outs:
                break
        stats = await idle_stats(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_structured_output_in_the_engine_core(cores: Cores, reference: Reference) -> None:
    """Grammars compile in the engine core (a bad one sent straight to it is an error output,
    counted), a request aborted while its grammar compiles is dropped, and a schema sent twice
    compiles once."""
    prompt = reference.chat("Describe a cat as JSON.")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "lives": {"enum": [1, 9]}},
        "required": ["name", "lives"],
        "additionalProperties": False,
    }
    so = StructuredOutputsParams(json=json.dumps(schema))
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    async with fresh_engine(cores) as engine:
        with pytest.raises(RequestError, match=r"^regex: "):
            await _generate(
                engine,
                prompt,
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="((")),
            )
        with trio.move_on_after(0.001):  # cancelled while its grammar compiles, or just after
            await _generate(engine, prompt, params)
        texts = [(await _generate(engine, prompt, params)).outputs[0].text for _ in range(2)]
        assert texts[0] == texts[1]
        value = json.loads(texts[0])
        assert set(value) == {"name", "lives"} and value["lives"] in (1, 9)
        stats = await idle_stats(engine)
        assert stats["grammars_compiling"] == 0 and stats["grammar_errors"] == 1
        assert stats["grammars_compiled"] == 1 and stats["grammar_cache_hits"] >= 1
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_engine_death_fails_requests_at_once(model_dir: Path, reference: Reference) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async with open_engine(str(model_dir), **F32) as engine:
        pid = engine.pid
        with pytest.raises(EngineDeadError):
            with trio.fail_after(5):
                async for out in engine.generate(reference.encode(PROMPTS[1]), long):
                    if len(out.outputs[0].token_ids) == 2:
                        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await _generate(engine, reference.encode(PROMPTS[0]))


async def test_utility_calls_sleep_wake_and_reset_prefix_cache(
    cores: Cores, reference: Reference
) -> None:
    prompt = reference.encode("You are a helpful assistant who answers briefly. " * 4 + "Hi!")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    async with fresh_engine(cores) as engine:
        await _generate(engine, prompt, params)
        assert (await _generate(engine, prompt, params)).num_cached_tokens > 0
        assert await engine.admin.reset_prefix_cache() is True
        assert (await _generate(engine, prompt, params)).num_cached_tokens == 0

        await engine.admin.sleep(level=0)
        assert await engine.admin.is_sleeping() is True
        results = []

        async def run() -> None:
            results.append(await _generate(engine, prompt, params))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            stats = await waiting(engine)
            assert not results  # asleep: no steps are taken
            assert stats["num_waiting_reqs"] == 1
            await engine.admin.wake_up()
        assert results[0].outputs[0].token_ids == reference.greedy(tuple(prompt), 4)
        assert await engine.admin.is_sleeping() is False
