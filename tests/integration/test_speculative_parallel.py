"""Speculative decoding (n-gram prompt lookup) across process boundaries: a tensor-parallel and
a pipeline-parallel world of two ranks on gloo, and a decode instance that loads its prompts'
KV from a prefill instance. Greedy output with speculation must equal greedy output without
it, token for token, with proposals verified, accepted and rejected on the way, every KV block
free again, and no engine or worker process left.

The model is a tiny random Llama, float32. Random weights copy nothing from their context, so
proposals hit only where the greedy output repeats itself: with `initializer_range` 0.12 the
first prompt below settles into a run of one token (a one-token proposal accepted each step),
the second into a run and then a two-token cycle (proposals of two accepted, and the first
proposal after each change rejected), and the third hardly repeats (few proposals, beside
the others' verify rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from kv_secret import secret_file
from processes import alive

from triode.actors import SamplingParams, open_engine
from triode.wire.kv_seal import read_secret, seal_remote_decode

pytestmark = pytest.mark.slow

PROMPTS = [
    [5, 17, 42, 9, 100, 3, 77, 12],
    [300, 301, 302, 303] * 5,
    [1000 + 7 * i for i in range(20)],
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, beside the deployment secret the KV instances share."""
    from triode.gpu.tiny_model import build_tiny_model

    directory = tmp_path_factory.mktemp("spec")
    secret_file(directory)
    return build_tiny_model(directory / "tiny", num_layers=2, initializer_range=0.12)


def _engine_args(**extra: object) -> dict[str, object]:
    return {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 1024, **extra}


def _kv(tiny: Path, role: str) -> dict[str, Any]:
    return {
        "kv_connector": "TriodeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "transport": "tcp",
            "secret_file": str(tiny.parent / "kv.secret"),
        },
    }


async def _generate_all(
    engine: Any, params: list[dict[str, Any] | None] | None = None
) -> list[list[int]]:
    """Every prompt's greedy tokens, all requests in flight together (batched steps)."""
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        transfer = None if params is None else params[i]
        async for out in engine.generate(PROMPTS[i], GREEDY, kv_transfer_params=transfer):
            results[i] = out.outputs[0].token_ids

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return results


def _assert_speculated(stats: dict[str, Any]) -> None:
    """Proposals were verified, some accepted (some beyond the first position: the two-token
    cycle) and some rejected; every KV block, rejected slots included, is free again."""
    assert stats["spec_num_drafts"] > 0, stats
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    per_pos = stats["spec_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_num_accepted_tokens"] and per_pos[1] > 0, stats
    assert _all_free(stats), stats


def _all_free(stats: dict[str, Any]) -> bool:
    return stats["num_free_blocks"] == stats["num_total_blocks"]


async def _gone(pids: list[int]) -> list[int]:
    """The `pids` still running once they all ended, or after five seconds."""
    with trio.move_on_after(5):
        while any(alive(p) for p in pids):  # noqa: ASYNC110 - other processes: we can only poll
            await trio.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
async def test_speculation_in_a_parallel_world_keeps_greedy_output(
    tiny: Path, tp: int, pp: int
) -> None:
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    started: list[int] = []
    async with open_engine(str(tiny), **_engine_args(**layout)) as plain:
        started += [*plain.pids, *plain.worker_pids]
        expected = await _generate_all(plain)
    spec_args = _engine_args(**layout, speculative_config=SPECULATIVE)
    async with open_engine(str(tiny), **spec_args) as engine:
        assert len(set(engine.worker_pids)) == tp * pp
        started += [*engine.pids, *engine.worker_pids]
        got = await _generate_all(engine)
        stats = await engine.get_stats()
    assert got == expected
    assert all(len(tokens) == NEW_TOKENS for tokens in got)
    _assert_speculated(stats)
    assert not await _gone(started)


async def test_a_speculating_decode_instance_keeps_a_colocated_greedy_output(tiny: Path) -> None:
    started: list[int] = []
    async with open_engine(str(tiny), **_engine_args()) as alone:
        started += [*alone.pids, *alone.worker_pids]
        expected = await _generate_all(alone)
    prefill_args = _engine_args(kv_transfer_config=_kv(tiny, "kv_producer"))
    decode_args = _engine_args(
        kv_transfer_config=_kv(tiny, "kv_consumer"), speculative_config=SPECULATIVE
    )
    secret = read_secret(str(tiny.parent / "kv.secret"))
    async with (
        open_engine(str(tiny), **prefill_args) as prefill,
        open_engine(str(tiny), **decode_args) as decode,
    ):
        started += [*prefill.pids, *prefill.worker_pids, *decode.pids, *decode.worker_pids]
        handed: list[dict[str, Any] | None] = []
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for prompt in PROMPTS:  # asked as the proxy asks: each seal serves one request
            asked = seal_remote_decode(secret, {"do_remote_decode": True})
            outputs = [out async for out in prefill.generate(prompt, one, kv_transfer_params=asked)]
            params = outputs[-1].kv_transfer_params
            assert params is not None and params["do_remote_prefill"], params
            handed.append(params)
        got = await _generate_all(decode, handed)
        stats = await decode.get_stats()
        # the decode computed each prompt's last token only: the rest came over
        assert stats["prompt_tokens_computed"] == len(PROMPTS), stats
        assert stats["prompt_tokens_transferred"] == sum(map(len, PROMPTS)) - len(PROMPTS), stats
        # the prefill frees the blocks it held for the decode once the decode loaded them
        with trio.fail_after(20):
            while not _all_free(await prefill.get_stats()):  # noqa: ASYNC110 - another engine
                await trio.sleep(0.05)
    assert got == expected
    _assert_speculated(stats)
    assert not await _gone(started)
