"""Mixture-of-experts routing of inputs a client picks: the tokens, hence the experts the router
takes, and with a prompt given as embeddings the activations themselves.

- Every token on the same experts, the worst imbalance: the step's rows stay tokens x top_k,
  each expert takes all of its rows (no capacity that drops a token or overflows, no buffer of
  experts x tokens; the batched product's grid is at most experts x `BATCHED_ROWS`), and the
  output is those experts' dense MLPs'. Under expert parallelism the rank holding them takes
  every pair, in both dispatches (all_to_all in a world of two ranks on gloo).
- Hidden states that are not finite (a bfloat16 model's cast of float32 embeddings past its
  range, which `receive_prompt_embeds` lets through as finite; NaN): the router still names
  distinct experts in range, every collective keeps its sizes, nothing raises, and the other
  tokens' outputs, and the other requests' tokens, are what they are without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from processes import RankPool, join_cpu_world

from triode.gpu.local_group import free_port
from triode.gpu.model_runner import ModelRunner
from triode.gpu.models import moe
from triode.gpu.models.moe import BATCHED_ROWS, Dispatch, Experts, Router, SparseMoeBlock
from triode.gpu.parallel_state import ParallelLayout
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import (
    NewRequestData,
    RequestStepResult,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)

HIDDEN, INTERMEDIATE = 16, 12
# the rows `_hostile` makes: NaN, one infinity of either sign, all infinite, infinities of
# both signs, and finite values whose router logits overflow float32
HOSTILE_ROWS = 6


def _weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, hidden], w13 [E, 2 x intermediate, hidden], w2 [E, hidden, intermediate]),
    the same in every process."""
    g = torch.Generator().manual_seed(num_experts)
    gate = torch.randn(num_experts, HIDDEN, generator=g)
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    return gate, w13, w2


def _herding(num_experts: int, favoured: list[int]) -> torch.Tensor:
    """A gate under which every token whose feature 0 is 1 (`_tokens`) scores `favoured`
    first, in that order, and every other expert 0."""
    gate = torch.zeros(num_experts, HIDDEN)
    for place, expert in enumerate(favoured):
        gate[expert, 0] = 40.0 - 10.0 * place
    return gate


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 1.0
    return x


def _hostile(x: torch.Tensor) -> torch.Tensor:
    """`x` with its first `HOSTILE_ROWS` rows made hostile."""
    x, inf = x.clone(), float("inf")
    x[0] = float("nan")
    x[1, 3] = inf
    x[2, 5] = -inf
    x[3] = inf
    x[4, ::2], x[4, 1::2] = inf, -inf
    x[5] = 3e38
    return x


def _block(
    num_experts: int,
    top_k: int,
    renormalize: bool,
    gate: torch.Tensor,
    *,
    expert_parallel: bool = False,
    dispatch: Dispatch = "allreduce",
) -> SparseMoeBlock:
    """A block of `_weights`' experts routed by `gate`: this rank's share of them under
    expert parallelism."""
    block = SparseMoeBlock(
        HIDDEN,
        INTERMEDIATE,
        num_experts,
        top_k,
        renormalize,
        expert_parallel=expert_parallel,
        dispatch=dispatch,
    )
    _, w13, w2 = _weights(num_experts)
    held = slice(block.experts.first, block.experts.first + block.experts.count)
    block.gate.weight.data = gate.clone()
    block.experts.w13.data = w13[held].clone()
    block.experts.w2.data = w2[held].clone()
    return block


def _dense(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Each token through each of its chosen experts' MLP on its own, weighted and summed."""
    _, w13, w2 = _weights(num_experts)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e])
    return out


def _herded_weights(favoured: list[int], num_experts: int, renormalize: bool) -> torch.Tensor:
    """The routing weights every herded token gets: the softmax of the gate's scores."""
    scores = _herding(num_experts, favoured)[:, 0]
    probs = torch.softmax(scores, dim=0)[favoured]
    return probs / probs.sum() if renormalize else probs


class _Rows:
    """What the experts compute, seen from `Experts.compute` and `Experts._batched`: the rows
    of each call and its per-expert counts, and the batched grid's rows."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, list[int]]] = []
        self.grids: list[int] = []
        compute, batched = Experts.compute, Experts._batched

        def seen_compute(experts: Experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            self.calls.append((rows.shape[0], list(counts)))
            return compute(experts, rows, counts)

        def seen_batched(experts: Experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            self.grids.append(len(counts) * max(counts))
            return batched(experts, rows, counts)

        monkeypatch.setattr(Experts, "compute", seen_compute)
        monkeypatch.setattr(Experts, "_batched", seen_batched)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "tokens", "renormalize", "batched"),
    [
        (8, 1, 300, True, False),  # Mixtral's renormalised weights, one expert: weight 1
        (8, 2, 300, False, False),  # Qwen3-MoE's raw ones
        (4, 2, 6, True, True),  # half the experts, few rows each: the batched product
    ],
)
def test_every_token_on_the_same_experts_is_their_dense_mlp(
    monkeypatch: pytest.MonkeyPatch,
    num_experts: int,
    top_k: int,
    tokens: int,
    renormalize: bool,
    batched: bool,
) -> None:
    favoured = [0, 1][:top_k]
    block = _block(num_experts, top_k, renormalize, _herding(num_experts, favoured))
    seen = _Rows(monkeypatch)
    x = _tokens(tokens)
    weights, chosen = block.gate(x)
    assert chosen.tolist() == [favoured] * tokens
    want_weights = _herded_weights(favoured, num_experts, renormalize)
    torch.testing.assert_close(weights, want_weights.expand(tokens, top_k))
    torch.testing.assert_close(block(x), _dense(x, chosen, weights, num_experts))
    # one call over every (token, choice) pair, all on the favoured experts: none dropped
    counts = [tokens if e in favoured else 0 for e in range(num_experts)]
    assert seen.calls == [(tokens * top_k, counts)]
    assert bool(seen.grids) == batched
    assert all(rows <= num_experts * BATCHED_ROWS for rows in seen.grids)


@pytest.mark.parametrize("favoured", [[0, 1], [0, 7]])
def test_expert_parallel_allreduce_gives_the_pairs_to_the_ranks_holding_their_experts(
    monkeypatch: pytest.MonkeyPatch, favoured: list[int]
) -> None:
    """Two ranks of four experts each, built in turn as each rank builds its own; their
    outputs summed, as the all-reduce does. [0, 1]: one rank takes every pair."""
    num_experts, tokens, top_k = 8, 40, 2
    seen = _Rows(monkeypatch)
    gate = _herding(num_experts, favoured)
    x = _tokens(tokens)
    out = torch.zeros_like(x)
    for rank in range(2):
        monkeypatch.setattr(moe, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(moe, "tp_size", lambda: 2)
        block = _block(num_experts, top_k, True, gate, expert_parallel=True)
        assert (block.experts.first, block.experts.count) == (4 * rank, 4)
        weights, chosen = block.gate(x)
        out += block.experts(x, weights, chosen)
    torch.testing.assert_close(out, _dense(x, chosen, weights, num_experts))
    per_rank = [sum(e // 4 == rank for e in favoured) * tokens for rank in range(2)]
    assert [rows for rows, _ in seen.calls] == per_rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_non_finite_hidden_states_pick_experts_in_range_and_stay_in_their_rows(
    dtype: torch.dtype, renormalize: bool
) -> None:
    num_experts, top_k = 8, 2
    block = _block(num_experts, top_k, renormalize, _weights(num_experts)[0]).to(dtype)
    clean = _tokens(24, seed=1).to(dtype)
    x = _hostile(clean)
    _, chosen = block.gate(x)
    assert 0 <= int(chosen.min()) and int(chosen.max()) < num_experts
    assert all(len(set(row)) == top_k for row in chosen.tolist())  # distinct, as topk's are
    out = block(x)
    assert not out[:HOSTILE_ROWS].isfinite().all(dim=1).any()  # what they carry, they keep
    want = block(clean[HOSTILE_ROWS:])
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out[HOSTILE_ROWS:], want, **tolerance)


def _all_to_all_rank(layout: ParallelLayout, port: int) -> list[tuple[torch.Tensor, list[int]]]:
    """One rank of a world of two, expert parallel with the all_to_all dispatch: (the output,
    the rows this rank's experts computed) of herded tokens, then of the same with hostile
    rows among them."""
    join_cpu_world(layout, port)
    gate = _herding(8, [0, 1])
    block = _block(8, 2, True, gate, expert_parallel=True, dispatch="all_to_all")
    rows: list[int] = []
    compute = block.experts.compute

    def seen(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        rows.append(x.shape[0])
        return compute(x, counts)

    block.experts.compute = seen  # type: ignore[method-assign]
    results = []
    for x in (_tokens(37), _hostile(_tokens(37))):
        rows.clear()
        results.append((block(x), list(rows)))
    return results


@pytest.mark.slow
def test_all_to_all_sends_every_pair_to_the_one_rank_that_holds_their_experts(
    rank_pool: RankPool,
) -> None:
    """37 tokens, 19 and 18 routed on each rank, all to experts 0 and 1 of rank 0: it receives
    all 74 pairs, rank 1 none; with hostile rows among them the exchanges keep their sizes and
    the clean rows their outputs."""
    port = free_port()
    ranks = rank_pool.run(_all_to_all_rank, [(ParallelLayout(2, 1, r), port) for r in range(2)])
    x = _tokens(37)
    weights = _herded_weights([0, 1], 8, True).expand(37, 2)
    want = _dense(x, torch.tensor([[0, 1]] * 37), weights, 8)
    (herded0, rows0), (hostile0, _) = ranks[0]
    (herded1, rows1), (hostile1, _) = ranks[1]
    assert rows0 == [74] and rows1 == [0]
    for out in (herded0, herded1):
        torch.testing.assert_close(out, want)
    torch.testing.assert_close(hostile0, hostile1, equal_nan=True)
    torch.testing.assert_close(hostile0[HOSTILE_ROWS:], want[HOSTILE_ROWS:])


# --- the families, in the model runner -------------------------------------------------------

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
CLEAN = [5, 17, 42, 9, 100, 3, 77, 12, 8]
BLOCK = 4


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-families")
    return {
        name: build_tiny_model(root / name, num_layers=2, **{"architecture": name, **spec})
        for name, spec in FAMILIES.items()
    }


def _runner(model_dir: Path, dtype: str) -> ModelRunner:
    return ModelRunner(
        model_dir,
        dtype=dtype,
        kv_cache_memory=1 << 21,
        max_model_len=64,
        block_size=BLOCK,
        num_threads=1,
    )


def _new(request_id: str, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id, list(CLEAN), 0, blocks, new=NewRequestData(list(CLEAN), GREEDY)
    )


def _embedded(request_id: str, rows: np.ndarray, blocks: list[int]) -> ScheduledRequest:
    ids = [0] * len(rows)
    new = NewRequestData(ids, GREEDY, prompt_embeds_dtype=str(rows.dtype))
    return ScheduledRequest(request_id, ids, 0, blocks, new=new, prompt_embeds=rows)


def _sampled(result: RequestStepResult) -> tuple[int, float]:
    assert result.token_id is not None and result.logprobs is not None
    return result.token_id, float(result.logprobs.logprobs[0][0])


def _decode(
    runner: ModelRunner, first: list[ScheduledRequest], blocks: dict[str, list[int]], steps: int
) -> dict[str, list[tuple[int, float]]]:
    """(token, its logprob) of each request: `first`'s step, then `steps` decodes of those
    in `blocks` (request id -> its block table)."""
    out = runner.execute(SchedulerOutput(step=0, requests=first))
    lengths = {r.request_id: len(r.token_ids) for r in first}
    got = {r.request_id: [_sampled(r)] for r in out.results}
    for step in range(1, steps + 1):
        requests = []
        for request_id, table in blocks.items():
            token = got[request_id][-1][0]
            requests.append(ScheduledRequest(request_id, [token], lengths[request_id], table))
            lengths[request_id] += 1
        for r in runner.execute(SchedulerOutput(step, requests)).results:
            got[r.request_id].append(_sampled(r))
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_request_of_non_finite_activations_leaves_the_batch_alone(
    families: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of NaN and infinite embeddings decodes beside a clean one, every step in
    the same products: the router keeps naming experts in range, and the clean request gets
    the tokens and logprobs it gets alone."""
    runner = _runner(families[family], "float32")
    routed: list[tuple[bool, int, int]] = []
    forward = Router.forward

    def seen(router: Router, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = forward(router, hidden)
        routed.append((bool(hidden.isfinite().all()), int(chosen.min()), int(chosen.max())))
        return weights, chosen

    monkeypatch.setattr(Router, "forward", seen)
    alone = _decode(runner, [_new("alone", [0, 1, 2, 3])], {"alone": [0, 1, 2, 3]}, 4)
    rows = _hostile(torch.zeros(HOSTILE_ROWS, runner.hidden_size)).numpy()
    first = [_new("clean", [4, 5, 6, 7]), _embedded("hostile", rows, [8, 9, 10])]
    beside = _decode(runner, first, {"clean": [4, 5, 6, 7], "hostile": [8, 9, 10]}, 4)
    assert [t for t, _ in beside["clean"]] == [t for t, _ in alone["alone"]]
    np.testing.assert_allclose(
        [lp for _, lp in beside["clean"]], [lp for _, lp in alone["alone"]], atol=1e-5
    )
    assert all(0 <= t < runner.vocab_size for t, _ in beside["hostile"])
    experts = FAMILIES[family].get("num_experts") or FAMILIES[family]["num_local_experts"]
    assert any(not finite for finite, _, _ in routed)  # the router did see them
    assert all(0 <= low and high < experts for _, low, high in routed)


def test_float32_embeddings_past_bfloat16s_range_reach_the_router_and_nothing_fails(
    families: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Embeddings that pass as finite in float32 are infinite in a bfloat16 model: its router
    sees non-finite hidden states from a request the engine core accepted."""
    runner = _runner(families["qwen3_moe"], "bfloat16")
    seen: list[bool] = []
    forward = Router.forward

    def spy(router: Router, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = forward(router, hidden)
        assert 0 <= int(chosen.min()) and int(chosen.max()) < 8
        seen.append(bool(hidden.isfinite().all()))
        return weights, chosen

    monkeypatch.setattr(Router, "forward", spy)
    rows = np.full((5, runner.hidden_size), 3.4e38, np.float32)
    assert np.isfinite(rows).all()
    first = [_new("clean", [0, 1, 2]), _embedded("hostile", rows, [3, 4])]
    got = _decode(runner, first, {"clean": [0, 1, 2], "hostile": [3, 4]}, 2)
    assert not all(seen)
    assert all(np.isfinite(lp) for _, lp in got["clean"])


def test_a_finished_requests_non_finite_cache_stays_out_of_the_next_owners_attention(
    families: dict[str, Path],
) -> None:
    """float16 on the CPU decodes through torch's attention, as every dtype does on CUDA. A
    request of embeddings finite in float32 but not in float16 leaves NaN keys and values in
    its block; the next owner of that block, whose context ends inside it, must not read
    them."""
    runner = _runner(families["qwen3_moe"], "float16")
    alone = _decode(runner, [_new("alone", [0, 1, 2])], {"alone": [0, 1, 2]}, 2)
    rows = np.full((BLOCK, runner.hidden_size), 1e5, np.float32)
    runner.execute(SchedulerOutput(step=0, requests=[_embedded("hostile", rows, [3])]))
    runner.execute(SchedulerOutput(step=1, requests=[], finished_request_ids=["hostile"]))
    # the 9-token prompt and two decodes end inside its third block, the one freed
    after = _decode(runner, [_new("after", [4, 5, 3])], {"after": [4, 5, 3]}, 2)
    assert after["after"] == alone["alone"]
