"""Tensor and pipeline parallelism on gloo: real rank processes, tiny random models, float32.

Each world runs the same steps (two prompts' prefill, then greedy decodes) through
`ModelRunner.execute` on every rank; the driver's results must equal a world of one: the same
tokens, and log-probabilities (top 20 of every prompt position and of every sampled token)
within 1e-4.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from processes import RankPool, join_cpu_world

from triode.gpu.local_group import free_port
from triode.gpu.parallel_state import ParallelLayout, partition
from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.slow

PROMPTS = {"a": [5, 17, 42, 9, 100, 3, 77, 12, 8, 61, 33], "b": [250, 4, 19, 7, 88]}
DECODE_STEPS = 6
BLOCK = 4


def _first_step() -> tuple[SchedulerOutput, dict[str, list[int]]]:
    """Both prompts' prefill in one step, and each request's block table."""
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=20, prompt_logprobs=20)
    blocks = {"a": list(range(0, 6)), "b": list(range(6, 12))}
    requests = [
        ScheduledRequest(rid, ids, 0, blocks[rid], new=NewRequestData(ids, params))
        for rid, ids in PROMPTS.items()
    ]
    return SchedulerOutput(step=0, requests=requests), blocks


def _rank_main(layout: ParallelLayout, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from triode.gpu import object_collectives, parallel_state
    from triode.gpu.model_runner import ModelRunner

    join_cpu_world(layout, port)

    runner = ModelRunner(
        Path(model_dir),
        dtype="float32",
        kv_cache_memory=1 << 20,
        block_size=BLOCK,
        max_model_len=64,
        device="cpu",
        num_threads=1,
    )
    first, blocks = _first_step()
    outputs = [runner.execute(first)]
    # every rank builds the same decode steps: the tokens travel with the driver's results in
    # the engine; here all ranks take them from a broadcast
    history = {rid: list(ids) for rid, ids in PROMPTS.items()}
    for step in range(1, DECODE_STEPS + 1):
        tokens = [0] * len(PROMPTS)
        if layout.is_driver:
            tokens = [r.token_id for r in outputs[-1].results]
        sampled = object_collectives.broadcast(tokens, list[int], src=layout.driver_rank)
        requests = []
        for rid, token in zip(PROMPTS, sampled, strict=True):
            history[rid].append(token)
            requests.append(ScheduledRequest(rid, [token], len(history[rid]) - 1, blocks[rid]))
        outputs.append(runner.execute(SchedulerOutput(step=step, requests=requests)))
    if layout.is_driver:
        Path(out).write_bytes(pickle.dumps([_plain(o) for o in outputs]))
    dist.barrier()
    parallel_state.destroy_distributed()


def _plain(output: object) -> list[tuple[str, int | None, object, object]]:
    rows = []
    for r in output.results:  # type: ignore[attr-defined]
        logprobs = None if r.logprobs is None else (r.logprobs.token_ids, r.logprobs.logprobs)
        prompt = (
            None
            if r.prompt_logprobs is None
            else (r.prompt_logprobs.token_ids, r.prompt_logprobs.logprobs)
        )
        rows.append((r.request_id, r.token_id, logprobs, prompt))
    return rows


def _run_world(pool: RankPool, model_dir: Path, tp: int, pp: int, tmp_path: Path) -> list[object]:
    port = free_port()
    out = tmp_path / f"tp{tp}-pp{pp}.pkl"
    layouts = [ParallelLayout(tp, pp, rank) for rank in range(tp * pp)]
    pool.run(_rank_main, [(layout, port, str(model_dir), str(out)) for layout in layouts])
    return pickle.loads(out.read_bytes())


def _assert_same(expected: list[object], got: list[object]) -> None:
    import numpy as np

    assert len(expected) == len(got)
    for want_step, got_step in zip(expected, got, strict=True):
        assert [r[:2] for r in got_step] == [r[:2] for r in want_step]  # ids and greedy tokens
        for want, have in zip(want_step, got_step, strict=True):
            for a, b in ((want[2], have[2]), (want[3], have[3])):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(a[0][:, 0], b[0][:, 0])  # the chosen tokens
                    np.testing.assert_allclose(b[1], a[1], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from triode.gpu.tiny_model import build_tiny_model, build_uneven_tiny_model

    root = tmp_path_factory.mktemp("parallel-models")
    return {
        # grouped-query attention, 4 layers: two stages of two
        "even": build_tiny_model(root / "even", num_heads=4, num_kv_heads=2, num_layers=4),
        "uneven": build_uneven_tiny_model(root / "uneven"),
        # sliding windows shorter than the prompts; Gemma 3 mixes windowed and full layers
        "qwen3": build_tiny_model(
            root / "qwen3", architecture="qwen3", num_layers=4, head_dim=16,
            sliding_window=6, use_sliding_window=True, max_window_layers=1,
        ),
        "gemma3": build_tiny_model(
            root / "gemma3", architecture="gemma3", num_layers=4, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=6, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def references(
    rank_pool: RankPool, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    tmp = tmp_path_factory.mktemp("tp1")
    return {name: _run_world(rank_pool, path, 1, 1, tmp) for name, path in tiny_models.items()}


# every layout on the Llama and Qwen2 shapes; the windowed families under TP and PP alone
WORLDS = [
    *((model, tp, pp) for model in ("even", "uneven") for tp, pp in ((2, 1), (1, 2), (2, 2))),
    *((model, tp, pp) for model in ("qwen3", "gemma3") for tp, pp in ((2, 1), (1, 2))),
]


@pytest.mark.parametrize(("model", "tp", "pp"), WORLDS)
def test_parallel_world_matches_a_world_of_one(
    rank_pool: RankPool,
    tiny_models: dict[str, Path],
    references: dict,
    tmp_path: Path,
    model: str,
    tp: int,
    pp: int,
) -> None:
    got = _run_world(rank_pool, tiny_models[model], tp, pp, tmp_path)
    _assert_same(references[model], got)


def test_a_world_of_one_is_a_single_stage_rank_zero() -> None:
    layout = ParallelLayout()
    assert (layout.world_size, layout.tp_rank, layout.pp_rank, layout.is_driver) == (1, 0, 0, True)


def test_layout_puts_a_stage_on_consecutive_ranks() -> None:
    layouts = [ParallelLayout(2, 3, r) for r in range(6)]
    assert [(x.pp_rank, x.tp_rank) for x in layouts] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    assert layouts[0].tp_group_ranks(1) == [2, 3]
    assert layouts[0].pp_group_ranks(1) == [1, 3, 5]
    assert [x.is_driver for x in layouts] == [False] * 4 + [True, False]
    assert layouts[3].prev_rank == 1 and layouts[3].next_rank == 5


def test_partition_splits_as_evenly_as_possible() -> None:
    assert partition(30, 4) == [(0, 8), (8, 8), (16, 7), (23, 7)]
    assert partition(3, 2) == [(0, 2), (2, 1)]
    with pytest.raises(ValueError):
        partition(1, 2)
