"""Mixture-of-experts families in parallel worlds on gloo: TP=2 (each expert's intermediate
dimension split), PP=2, and TP=2 with expert parallelism (whole experts split over the two
ranks) in both dispatch modes, each against a world of one: the same greedy tokens, and
top-20 logprobs of every sampled token and prompt position within 1e-4 (float32)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from processes import RankPool, join_cpu_world

from triode.gpu.local_group import free_port
from triode.gpu.parallel_state import ParallelLayout

pytestmark = pytest.mark.slow

# 20 prompt tokens in the first step, then 3 decodes a step, and a last step of one token,
# fewer than the ranks that share the tokens in the all_to_all dispatch
PROMPTS = {
    "a": [5, 17, 42, 9, 100, 3, 77, 12, 8, 61, 33],
    "b": [250, 4, 19, 7, 88],
    "c": [6, 2, 9, 1],
}
DECODE_STEPS = 5
BLOCK = 4
MODELS = {
    "qwen3-moe": {
        "architecture": "qwen3_moe",
        "num_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "mlp_only_layers": [2],
    },
    "mixtral": {
        "architecture": "mixtral",
        "num_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "tie_word_embeddings": False,
    },
}
# a GGUF file's experts, run from its blocks: each rank's cut of an expert's intermediate
# dimension (32 of 64) is whole Q8_0 blocks
GGUF_MODEL = "qwen3-moe-gguf"
# (every layer a MoE one: llama.cpp's qwen3moe has no dense MLP layer)
MODELS[GGUF_MODEL] = {**MODELS["qwen3-moe"], "moe_intermediate_size": 64, "mlp_only_layers": []}
# (tp, pp) -> the runs one world makes in turn, each a fresh runner: (expert parallel, dispatch)
WORLDS = {
    "TP=2": (2, 1, [(False, "allreduce"), (True, "allreduce"), (True, "all_to_all")]),
    "PP=2": (1, 2, [(False, "allreduce")]),
}
Run = tuple[bool, str]


def _rank_main(
    layout: ParallelLayout, port: int, model_dir: str, out: str, runs: list[Run]
) -> None:
    import torch
    import torch.distributed as dist

    from triode.gpu import parallel_state

    torch.set_num_threads(1)
    parallel = layout.world_size > 1
    if parallel:
        join_cpu_world(layout, port)
    results = [_decode(layout, Path(model_dir), ep, dispatch) for ep, dispatch in runs]
    if layout.is_driver:
        Path(out).write_bytes(pickle.dumps(results))
    if parallel:
        dist.barrier()
        parallel_state.destroy_distributed()


def _decode(layout: ParallelLayout, model_dir: Path, ep: bool, dispatch: str) -> tuple:
    """(the driver's results of every step, how many experts each of its blocks holds)."""
    from triode.gpu import object_collectives
    from triode.gpu.model_runner import ModelRunner
    from triode.gpu.models.moe import SparseMoeBlock
    from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

    runner = ModelRunner(
        model_dir,
        dtype="float32",
        kv_cache_memory=1 << 20,
        block_size=BLOCK,
        max_model_len=64,
        device="cpu",
        num_threads=1,
        enable_expert_parallel=ep,
    )
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.dispatch = dispatch  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=20, prompt_logprobs=20)
    table = {rid: list(range(i * 8, (i + 1) * 8)) for i, rid in enumerate(PROMPTS)}
    requests = [
        ScheduledRequest(rid, ids, 0, table[rid], new=NewRequestData(ids, params))
        for rid, ids in PROMPTS.items()
    ]
    outputs = [runner.execute(SchedulerOutput(step=0, requests=requests))]
    history = {rid: list(ids) for rid, ids in PROMPTS.items()}
    for step in range(1, DECODE_STEPS + 2):
        tokens = [r.token_id for r in outputs[-1].results] if layout.is_driver else [0] * 3
        if layout.world_size > 1:
            tokens = object_collectives.broadcast(tokens, list[int], src=layout.driver_rank)
        live = list(PROMPTS) if step <= DECODE_STEPS else ["a"]
        requests = []
        for rid, token in zip(PROMPTS, tokens, strict=True):
            history[rid].append(token)
            if rid in live:
                computed = len(history[rid]) - 1
                requests.append(ScheduledRequest(rid, [token], computed, table[rid]))
        finished = [rid for rid in PROMPTS if rid not in live]
        outputs.append(
            runner.execute(SchedulerOutput(step, requests, finished_request_ids=finished))
        )
    held = [(block.experts.count, block.experts.expert_kernels is not None) for block in blocks]
    return [_plain(o) for o in outputs], held


def _plain(output: object) -> list[tuple[str, int | None, object, object]]:
    rows = []
    for r in output.results:  # type: ignore[attr-defined]
        logprobs = None if r.logprobs is None else (r.logprobs.token_ids, r.logprobs.logprobs)
        prompt = r.prompt_logprobs
        prompt = None if prompt is None else (prompt.token_ids, prompt.logprobs)
        rows.append((r.request_id, r.token_id, logprobs, prompt))
    return rows


def _run_world(
    pool: RankPool, model_dir: Path, tp: int, pp: int, runs: list[Run], out: Path
) -> list:
    port = free_port()
    layouts = [ParallelLayout(tp, pp, rank) for rank in range(tp * pp)]
    pool.run(_rank_main, [(lay, port, str(model_dir), str(out), runs) for lay in layouts])
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from gguf import GGMLQuantizationType
    from gguf_families import write_bpe_tokenizer, write_gguf

    from triode.gpu.loader import convert_gguf
    from triode.gpu.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("moe-parallel")
    tokenizer = write_bpe_tokenizer(root / "tokenizer")
    out = {}
    for name, spec in MODELS.items():
        if name == GGUF_MODEL:
            source = build_tiny_model(root / name, tokenizer_from=tokenizer, **spec)
            q8 = GGMLQuantizationType.Q8_0
            gguf = write_gguf(source, root / f"{name}.gguf", projection_type=q8)
            with pytest.MonkeyPatch.context() as patch:  # converted under the module's folder
                patch.setenv("TRIODE_CACHE", str(root / "cache"))
                out[name] = convert_gguf(gguf)
        else:
            out[name] = build_tiny_model(root / name, **spec)
    return out


@pytest.fixture(scope="module")
def references(
    rank_pool: RankPool, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    tmp = tmp_path_factory.mktemp("world-of-one")
    one: list[Run] = [(False, "allreduce")]
    return {
        name: _run_world(rank_pool, path, 1, 1, one, tmp / f"{name}.pkl")[0][0]
        for name, path in models.items()
    }


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("model", list(MODELS))
def test_moe_world_matches_a_world_of_one(
    rank_pool: RankPool,
    models: dict[str, Path],
    references: dict,
    tmp_path: Path,
    model: str,
    world: str,
) -> None:
    tp, pp, runs = WORLDS[world]
    spec = MODELS[model]
    experts = spec.get("num_experts") or spec["num_local_experts"]
    results = _run_world(rank_pool, models[model], tp, pp, runs, tmp_path / "out.pkl")
    for (ep, dispatch), (got, held) in zip(runs, results, strict=True):
        run = f"{world}, expert parallel {ep}, {dispatch}"
        assert {count for count, _ in held} == {experts // tp if ep else experts}, run
        assert {packed for _, packed in held} == {model == GGUF_MODEL}, run  # the file's blocks
        _assert_same(references[model], got, run)


def _assert_same(want: list, got: list, run: str) -> None:
    assert len(got) == len(want), run
    for want_step, got_step in zip(want, got, strict=True):
        # ids and greedy tokens
        assert [r[:2] for r in got_step] == [r[:2] for r in want_step], run
        for a_row, b_row in zip(want_step, got_step, strict=True):
            for a, b in ((a_row[2], b_row[2]), (a_row[3], b_row[3])):
                assert (a is None) == (b is None), run
                if a is not None:
                    np.testing.assert_array_equal(a[0][:, 0], b[0][:, 0], err_msg=run)
                    np.testing.assert_allclose(b[1], a[1], atol=1e-4, rtol=0, err_msg=run)
