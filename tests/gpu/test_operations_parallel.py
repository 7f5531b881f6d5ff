"""The administrative operations on every rank of a tensor x pipeline parallel world (gloo, real
rank processes): each rank sleeps and wakes its shard, takes a pushed partial update and a new
checkpoint, each cut to its shard and stage, and the world then decodes what a world of one
decodes on those weights."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import RankPool, join_cpu_world
from safetensors.torch import load_file, save_file

from triode.gpu.local_group import free_port
from triode.gpu.model_runner import ModelRunner
from triode.gpu.parallel_state import ParallelLayout
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.slow

PROMPTS = {"a": [5, 17, 42, 9, 100, 3, 77, 12, 8, 61, 33], "b": [250, 4, 19, 7, 88]}
DECODE_STEPS = 5
BLOCK = 4
# tensors of both pipeline stages: the tied embedding (the first stage's lookup, the last
# stage's LM head), one shard of a merged projection, a row-parallel projection, a norm
PUSHED = [
    "model.embed_tokens.weight",
    "model.layers.3.self_attn.k_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.1.post_attention_layernorm.weight",
]

Outputs = list[list[tuple[str, int | None, np.ndarray]]]


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir,
        dtype="float32",
        kv_cache_memory=1 << 20,
        block_size=BLOCK,
        max_model_len=64,
        device="cpu",
        num_threads=1,
    )


def _decode(runner: ModelRunner, share: Callable[[list[int]], list[int]], step0: int) -> Outputs:
    """Both prompts' prefill, then greedy decodes; `share` gives every rank the driver's
    tokens. Returns the driver's (request, token, logprobs) rows per step."""
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5)
    ids = {rid: f"{rid}{step0}" for rid in PROMPTS}
    blocks = {"a": list(range(0, 6)), "b": list(range(6, 12))}
    requests = [
        ScheduledRequest(ids[rid], p, 0, blocks[rid], new=NewRequestData(p, params))
        for rid, p in PROMPTS.items()
    ]
    history = {rid: list(p) for rid, p in PROMPTS.items()}
    outputs = []
    for step in range(DECODE_STEPS + 1):
        out = runner.execute(SchedulerOutput(step=step0 + step, requests=requests))
        outputs.append([(r.request_id, r.token_id, r.logprobs.logprobs) for r in out.results])
        tokens = share([r.token_id for r in out.results] or [0] * len(PROMPTS))
        requests = []
        for rid, token in zip(PROMPTS, tokens, strict=True):
            history[rid].append(token)
            requests.append(ScheduledRequest(ids[rid], [token], len(history[rid]) - 1, blocks[rid]))
    runner.execute(
        SchedulerOutput(step=step0 + 99, requests=[], finished_request_ids=[*ids.values()])
    )
    return outputs


def _rank_main(layout: ParallelLayout, port: int, dirs: dict[str, str], out: str) -> None:
    from triode.gpu import object_collectives, parallel_state
    from triode.gpu.operations import Operations

    join_cpu_world(layout, port)

    def share(tokens: list[int]) -> list[int]:
        return object_collectives.broadcast(tokens, list[int], src=layout.driver_rank)

    runner = _runner(Path(dirs["original"]))
    ops = Operations(runner)
    ops.sleep(["weights", "kv_cache"])
    ops.wake_up(["kv_cache", "weights"])
    pushed = load_file(Path(dirs["patched"]) / "model.safetensors")
    ops.start_weight_update()
    ops.apply_weights([(name, pushed[name]) for name in PUSHED[:2]])
    ops.apply_weights([(name, pushed[name]) for name in PUSHED[2:]])
    ops.finish_weight_update()
    results = {"patched": _decode(runner, share, 0)}
    ops.update_weights_from_disk(dirs["changed"])
    results["changed"] = _decode(runner, share, 100)
    if layout.is_driver:
        Path(out).write_bytes(pickle.dumps(results))
    torch.distributed.barrier()
    parallel_state.destroy_distributed()


def _copy(src: Path, dst: Path, names: list[str] | None, seed: int) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if names is None or name in names:
            tensors[name] = t + torch.randn(t.shape, generator=g) * t.std() / 3
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_every_rank_takes_its_share_of_each_operation(rank_pool: RankPool, tmp_path: Path) -> None:
    original = build_tiny_model(tmp_path / "original", num_layers=4)
    dirs = {
        "original": original,
        "patched": _copy(original, tmp_path / "patched", PUSHED, 1),
        "changed": _copy(original, tmp_path / "changed", None, 2),
    }
    port, out = free_port(), tmp_path / "results.pkl"
    names = {k: str(v) for k, v in dirs.items()}
    layouts = [ParallelLayout(2, 2, rank) for rank in range(4)]
    rank_pool.run(_rank_main, [(layout, port, names, str(out)) for layout in layouts])
    got = pickle.loads(out.read_bytes())
    for name in ("patched", "changed"):
        expected = _decode(_runner(dirs[name]), lambda tokens: tokens, 0)
        for want, have in zip(expected, got[name], strict=True):
            assert [r[1] for r in have] == [r[1] for r in want], name
            for a, b in zip(want, have, strict=True):
                np.testing.assert_allclose(b[2], a[2], atol=1e-4, rtol=0)
    before = _decode(_runner(original), lambda tokens: tokens, 0)
    assert not np.allclose(before[0][0][2], got["patched"][0][0][2], atol=1e-3)
