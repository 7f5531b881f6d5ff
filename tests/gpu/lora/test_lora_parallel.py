"""A LoRA adapter under tensor and pipeline parallelism: two gloo ranks, each holding its cut of
the adapter (tensor parallel: on a model whose 3 KV heads split 2 + 1, the uneven cut of the
attention output's columns, which the adapter's o_proj A must follow; pipeline parallel: its
stage's layers), give what one rank gives."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lora_builders import build_adapter
from processes import RankPool, join_cpu_world
from runner_driver import GREEDY

from triode.gpu.local_group import free_port
from triode.gpu.parallel_state import ParallelLayout
from triode.wire import NewRequestData, ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.slow

PROMPTS = {"a": ([5, 17, 42, 9, 100, 3, 77, 12, 8, 61, 33], 1), "b": ([250, 4, 19, 7, 88], 0)}
BLOCKS = {"a": list(range(0, 6)), "b": list(range(6, 12))}
DECODE_STEPS = 5


def _steps(
    model_dir: str, adapter: str, broadcast: Callable[[list[int]], list[int]], driver: bool
) -> list[list[tuple[str, int | None, Any]]]:
    """Prefill both prompts (a with the adapter), then decode; each step's (request, token,
    logprobs) on the driver."""
    from triode.gpu.model_runner import ModelRunner
    from triode.gpu.operations import Operations

    runner = ModelRunner(
        Path(model_dir),
        dtype="float32",
        kv_cache_memory=1 << 20,
        block_size=4,
        max_model_len=64,
        device="cpu",
        num_threads=1,
        lora_config={"max_loras": 1, "max_lora_rank": 8},
    )
    Operations(runner).add_lora(1, adapter)
    requests = [
        ScheduledRequest(rid, ids, 0, BLOCKS[rid], new=NewRequestData(ids, GREEDY, lora_id=lora))
        for rid, (ids, lora) in PROMPTS.items()
    ]
    outputs = [runner.execute(SchedulerOutput(0, requests))]
    history = {rid: list(ids) for rid, (ids, _) in PROMPTS.items()}
    for step in range(1, DECODE_STEPS + 1):
        tokens = [r.token_id for r in outputs[-1].results] if driver else [0] * len(PROMPTS)
        requests = []
        for rid, token in zip(PROMPTS, broadcast(tokens), strict=True):
            history[rid].append(token)
            requests.append(ScheduledRequest(rid, [token], len(history[rid]) - 1, BLOCKS[rid]))
        outputs.append(runner.execute(SchedulerOutput(step, requests)))
    return [[(r.request_id, r.token_id, r.logprobs.logprobs) for r in o.results] for o in outputs]


def _rank_main(layout: ParallelLayout, port: int, model_dir: str, adapter: str, out: str) -> None:
    import torch.distributed as dist

    from triode.gpu import object_collectives, parallel_state

    join_cpu_world(layout, port)

    def broadcast(tokens: list[int]) -> list[int]:
        return object_collectives.broadcast(tokens, list[int], src=layout.driver_rank)

    outputs = _steps(model_dir, adapter, broadcast, layout.is_driver)
    if layout.is_driver:
        Path(out).write_bytes(pickle.dumps(outputs))
    dist.barrier()
    parallel_state.destroy_distributed()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_with_an_adapter_match_one(
    rank_pool: RankPool, tmp_path: Path, tp: int, pp: int
) -> None:
    from triode.gpu.tiny_model import build_uneven_tiny_model

    model_dir = build_uneven_tiny_model(tmp_path / "uneven")
    adapter = build_adapter(
        model_dir, tmp_path / "adapter", seed=7, r=8, lora_alpha=16, target_modules="all-linear"
    )
    expected = _steps(str(model_dir), str(adapter), lambda tokens: tokens, True)
    out = tmp_path / "tp2.pkl"
    port = free_port()
    args = [
        (ParallelLayout(tp, pp, rank), port, str(model_dir), str(adapter), str(out))
        for rank in (0, 1)
    ]
    rank_pool.run(_rank_main, args)
    got = pickle.loads(out.read_bytes())
    assert [[r[:2] for r in step] for step in got] == [[r[:2] for r in step] for step in expected]
    for want_step, got_step in zip(expected, got, strict=True):
        for want, have in zip(want_step, got_step, strict=True):
            np.testing.assert_allclose(have[2], want[2], atol=1e-4, rtol=0)
