"""Verification of speculative proposals: greedy requests emit what greedy decoding would,
sampled ones what sampling one token at a time would (in distribution), seeded ones exactly
what it would whatever was proposed, and logprobs describe the raw rows the tokens were emitted
from."""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest
import torch

from triode.gpu.rejection_sampler import verify
from triode.gpu.sampler import Sampler
from triode.gpu.sampling_state import SamplingState
from triode.wire.messages import SamplingParams

VOCAB = 64
EOS = 5
PROMPT = [1, 2, 3]


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    # Unseeded requests draw from torch's global generator: fixing it keeps the statistical
    # tests deterministic.
    torch.manual_seed(1234)


def state(vocab: int = VOCAB, output: tuple[int, ...] = (), **params: Any) -> SamplingState:
    s = SamplingState(SamplingParams(**params), PROMPT, EOS, vocab)
    for t in output:
        s.append(t)
    return s


def step_by_step(rows: torch.Tensor, s: SamplingState, draft: list[int]) -> list[int]:
    """What one-token-at-a-time decoding with the sampler emits over `rows` (row j following
    draft[:j]): it goes on while it samples the proposals. Appends to `s`."""
    tokens: list[int] = []
    for j in range(len(draft) + 1):
        token = Sampler()(rows[j : j + 1], [s]).token_ids[0]
        s.append(token)
        tokens.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return tokens


GREEDY_PARAMS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.8},
    {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"temperature": 0.0, "min_tokens": 4},
    {"temperature": 0.7, "top_k": 1, "logit_bias": {9: 1.5}},
]


@pytest.mark.parametrize("params", GREEDY_PARAMS, ids=lambda p: "-".join(p) or "plain")
def test_greedy_verification_equals_greedy_decoding(params: dict[str, Any]) -> None:
    # Sharp rows (x4) with ties between few tokens, so penalties and min_tokens change argmaxes.
    k = 4
    rows = torch.randn(k + 1, VOCAB) * 4
    rows[[1, 3], EOS] = rows.max() + 0.5  # EOS leads two rows; min_tokens holds it back
    output = (7, 7, 9)

    def fresh() -> SamplingState:
        return state(output=output, **params)

    # The tokens greedy decoding takes over these rows when every proposal is right.
    best: list[int] = []
    s = fresh()
    for j in range(k + 1):
        best.append(Sampler()(rows[j : j + 1], [s]).token_ids[0])
        s.append(best[-1])
    wrong = [(t + 1) % VOCAB for t in best]
    drafts = [
        best[:k],  # all accepted
        [],
        [wrong[0], *best[1:k]],  # rejected at once
        [*best[:2], wrong[2], best[3]],  # rejected at 2
        [*best[:3], wrong[3]],  # rejected at the last proposal
        best[:2],  # fewer proposals, all accepted
    ]
    batch = torch.cat([rows[: len(d) + 1] for d in drafts])
    states = [fresh() for _ in drafts]
    out = verify(batch, states, drafts)

    assert out[0][0] == best
    for d, s, (tokens, logprobs) in zip(drafts, states, out, strict=True):
        assert list(s.output_token_ids) == list(output), "verify appended to the state"
        assert tokens == step_by_step(rows, fresh(), d)
        assert logprobs is None
    assert [len(t) for t, _ in out] == [5, 1, 1, 3, 4, 3]


@pytest.mark.parametrize(
    "params",
    [{"repetition_penalty": 2.0}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}],
    ids=["repetition", "presence", "frequency"],
)
def test_greedy_rows_are_penalised_for_the_proposals_before_them(params: dict[str, Any]) -> None:
    # Every row prefers 7 to 9; once 7 is in the output its penalty reverses that.
    rows = torch.zeros(3, VOCAB)
    rows[:, 7], rows[:, 9] = 2.0, 1.5
    s = state(temperature=0.0, **params)
    tokens, _ = verify(rows, [s], [[7, 7]])[0]
    assert tokens == [7, 9]  # the second 7 is refused: row 1 follows a 7
    assert tokens == step_by_step(rows, state(temperature=0.0, **params), [7, 7])


def test_min_tokens_holds_eos_back_only_in_rows_where_the_output_is_short() -> None:
    rows = torch.zeros(4, VOCAB)
    rows[:, EOS], rows[:, 20] = 10.0, 8.0
    s = state(temperature=0.0, min_tokens=2, output=(30,))
    # Row 0 follows one output token, row 1 two: EOS is held back in row 0 only.
    tokens, _ = verify(rows, [s], [[20, 20, 20]])[0]
    assert tokens == [20, EOS]
    assert tokens == step_by_step(
        rows, state(temperature=0.0, min_tokens=2, output=(30,)), [20] * 3
    )


def test_greedy_requests_beside_sampled_ones_are_unaffected() -> None:
    rows = torch.randn(3, VOCAB)
    best = rows.argmax(dim=-1).tolist()
    others = torch.randn(5, VOCAB)
    logits = torch.cat([others[:2], rows, others[2:]])
    states = [state(top_p=0.8), state(temperature=0.0), state(seed=3)]
    out = verify(logits, states, [[4], best[:2], [1, 2]])
    assert out[1][0] == best


# A bigram model over a tiny vocabulary: the logits after token a are BIGRAM[a].
SMALL = 6
BIGRAM = torch.randn(SMALL, SMALL, generator=torch.Generator().manual_seed(7)) * 1.2
START = 0
SAMPLES = 12_000
SEEDED_SAMPLES = 6_000  # a generator each: slower
SAMPLING = {
    "plain": {"temperature": 0.8},
    "min_p": {"temperature": 1.0, "min_p": 0.15},
    "truncated": {"temperature": 1.3, "top_k": 4, "top_p": 0.85},
}


def target(context: int, params: dict[str, Any]) -> torch.Tensor:
    """The distribution the sampler draws from after `context`: temperature, then top-k, top-p
    (over the top-k set) and min-p, each renormalising."""
    p = torch.softmax(BIGRAM[context] / params.get("temperature", 1.0), dim=-1)
    order = p.argsort(descending=True)
    keep = torch.zeros(SMALL, dtype=torch.bool)
    keep[order[: params.get("top_k", 0) or SMALL]] = True
    p = torch.where(keep, p, 0.0) / p[keep].sum()
    ranked = p[order]
    before = ranked.cumsum(0) - ranked
    keep[order[before >= params.get("top_p", 1.0)]] = False
    p = torch.where(keep, p, 0.0)
    p = torch.where(p >= params.get("min_p", 0.0) * p.max(), p, 0.0)
    return p / p.sum()


def proposal(context: int, params: dict[str, Any], kind: str) -> int:
    """A likely token, an unlikely one (the least likely that can be drawn), or one that cannot
    be drawn."""
    p = target(context, params)
    if kind == "likely":
        return int(p.argmax())
    if kind == "unlikely":
        return int(torch.where(p > 0, p, 2.0).argmin())
    return int(p.argmin())


def wilson_hilferty_999(df: int) -> float:
    """The chi-squared distribution's 0.999 quantile (Wilson-Hilferty, within ~1% for df >= 3:
    16.27 at df 3, 29.59 at 10, 52.62 at 25)."""
    z, a = 3.0902, 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def assert_fits(counts: collections.Counter[int], probs: torch.Tensor) -> None:
    """Chi-squared goodness of fit at the 0.999 level; cells expecting fewer than 5 pooled.
    A cell of probability 0 must stay empty."""
    total = sum(counts.values())
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    expected = probs.double() * total
    assert observed[expected == 0].sum() == 0, "drew a token of probability 0"
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    o = torch.cat([observed[big], observed[small].sum().unsqueeze(0)])
    e = torch.cat([expected[big], expected[small].sum().unsqueeze(0)])
    o, e = o[e > 0], e[e > 0]
    statistic = float(((o - e) ** 2 / e).sum())
    assert statistic < wilson_hilferty_999(len(e) - 1), (statistic, len(e) - 1)


CASES = [
    ("plain", "likely", False),
    ("plain", "unlikely", False),
    ("min_p", "unlikely", False),
    ("min_p", "impossible", False),
    ("truncated", "likely", False),
    ("truncated", "unlikely", False),
    ("truncated", "impossible", False),
    ("plain", "unlikely", True),
    ("truncated", "likely", True),
]


@pytest.mark.parametrize(("sampling", "kind", "seeded"), CASES)
def test_emitted_tokens_are_distributed_as_sequential_sampling(
    sampling: str, kind: str, seeded: bool
) -> None:
    params = SAMPLING[sampling]
    first = proposal(START, params, kind)
    second = proposal(first, params, kind)
    p0 = target(START, params)
    assert (p0[first] == 0) == (kind == "impossible")

    # Step 1: every request proposes [first, second] after START. Unseeded requests without
    # penalties can share one state: verify reads it only.
    n = SEEDED_SAMPLES if seeded else SAMPLES
    shared = state(vocab=SMALL, **params)
    states = [state(vocab=SMALL, seed=i, **params) if seeded else shared for i in range(n)]
    rows = BIGRAM[[START, first, second]]
    out = verify(rows.repeat(n, 1), states, [[first, second]] * n)
    tokens = [t for t, _ in out]
    assert {len(t) for t in tokens} <= {1, 2, 3}

    # Step 2, for the requests that emitted one token: propose `second` again after it.
    short = [i for i, t in enumerate(tokens) if len(t) == 1]
    contexts = torch.tensor([[tokens[i][0], second] for i in short])
    logits = BIGRAM[contexts.flatten()]
    more = verify(logits, [states[i] for i in short], [[second]] * len(short))
    for i, (t, _) in zip(short, more, strict=True):
        tokens[i] = tokens[i] + t

    pairs = torch.stack([p0[a] * target(a, params) for a in range(SMALL)]).flatten()
    assert_fits(collections.Counter(t[0] for t in tokens), p0)
    assert_fits(collections.Counter(t[0] * SMALL + t[1] for t in tokens), pairs)
    accepted = sum(t[0] == first for t in tokens) / n
    assert abs(accepted - float(p0[first])) < 4 * math.sqrt(0.25 / n)  # 4 sigma at worst


def test_a_proposal_drawn_with_certainty_is_always_accepted() -> None:
    logits = torch.randn(30, VOCAB)
    states = [state(allowed_token_ids=[11], top_p=0.5 if i % 2 else 1.0) for i in range(10)]
    out = verify(logits, states, [[11, 11]] * 10)
    assert [t for t, _ in out] == [[11, 11, 11]] * 10


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.9}, {"top_p": 0.9, "min_p": 0.02}, {"top_k": 8, "repetition_penalty": 1.3}],
    ids=["plain", "top_p", "top_k"],
)
def test_seeded_requests_repeat(params: dict[str, Any]) -> None:
    drafts = [[3, 4, 5], [], [6], [7, 8]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB)
    # Flat rows: proposals are accepted and refused often enough that both paths are taken.
    logits[:, :10] += 3.0

    def run() -> list[list[int]]:
        states = [state(seed=10 + i, **params) for i in range(len(drafts))]
        tokens = []
        for _ in range(6):
            out = verify(logits, states, drafts)
            tokens.extend(t for t, _ in out)
            torch.rand(100)  # whatever else draws from the global generator
        return tokens

    first = run()
    assert run() == first
    assert len(set(map(tuple, first))) > 6


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.9}, {"top_p": 0.9, "min_p": 0.02}, {"top_k": 8, "frequency_penalty": 0.5}],
    ids=["plain", "top_p", "top_k"],
)
def test_seeded_requests_without_proposals_emit_what_the_sampler_would(
    params: dict[str, Any],
) -> None:
    steps = [torch.randn(3, VOCAB) * 2 for _ in range(8)]

    def run(sample: Any) -> list[list[int]]:
        states = [state(seed=i, **params) for i in range(3)]
        tokens = []
        for logits in steps:
            tokens.append(sample(logits, states))
            for s, t in zip(states, tokens[-1], strict=True):
                s.append(t)
        return tokens

    sampled = run(lambda logits, states: Sampler()(logits, states).token_ids)
    verified = run(lambda logits, states: [t[0] for t, _ in verify(logits, states, [[]] * 3)])
    assert verified == sampled


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.9},
        {"top_p": 0.9, "min_p": 0.02},
        {"top_k": 8, "repetition_penalty": 1.3},
        {"temperature": 1.2, "frequency_penalty": 0.4, "min_tokens": 3},
    ],
    ids=["plain", "top_p", "top_k", "penalties"],
)
def test_seeded_requests_emit_what_the_sampler_would_whatever_is_proposed(
    params: dict[str, Any],
) -> None:
    # Position i's logits are the same whatever came before, so sampling one token at a time
    # and verifying proposals see the same rows; how many proposals each step verifies, and
    # which of them are wrong, must not change a seeded request's tokens.
    length = 40
    positions = torch.randn(length + 8, VOCAB)
    positions[:, :6] += 2.5  # likely enough that right proposals are common

    reference = state(seed=21, **params)
    expected = []
    for i in range(length):
        expected.append(Sampler()(positions[i : i + 1], [reference]).token_ids[0])
        reference.append(expected[-1])

    plan = torch.Generator().manual_seed(5)
    for _ in range(3):
        s, tokens = state(seed=21, **params), []
        while len(tokens) < length:
            k = int(torch.randint(0, 5, (1,), generator=plan))
            draft = expected[len(tokens) : len(tokens) + k]
            if draft and bool(torch.rand(1, generator=plan) < 0.4):
                wrong = int(torch.randint(0, len(draft), (1,), generator=plan))
                draft[wrong] = (draft[wrong] + 1) % VOCAB
            rows = positions[len(tokens) : len(tokens) + len(draft) + 1]
            neighbour = state(seed=3, top_k=4)  # another seeded request in the same step
            (emitted, _), _ = verify(torch.cat([rows, rows[:1]]), [s, neighbour], [draft, []])
            for t in emitted:
                s.append(t)
            tokens.extend(emitted)
            torch.rand(100)  # whatever else draws from the global generator
        assert tokens[:length] == expected


def test_logprobs_are_of_the_raw_rows_the_tokens_were_emitted_from() -> None:
    drafts = [[3, 4], [9], [], [1, 2, 3]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB) * 2
    # Request 0's proposals are its argmaxes (all accepted); its penalty changes the rows it
    # samples from, not the logprobs.
    logits[0, 3] = logits[1, 4] = 20.0
    states = [
        state(temperature=0.0, logprobs=3, presence_penalty=0.5),
        state(logprobs=0),
        state(top_p=0.9),
        state(seed=2, top_k=5, logprobs=2),
    ]
    out = verify(logits, states, drafts)
    raw = torch.log_softmax(logits, dim=-1)
    starts = [0, 3, 5, 6]
    assert out[0][0][:2] == [3, 4]
    assert out[2][1] is None
    for i, k in ((0, 3), (1, 0), (3, 2)):
        tokens, lp = out[i]
        assert lp is not None
        rows = list(range(starts[i], starts[i] + len(tokens)))
        assert lp.token_ids.shape == lp.logprobs.shape == (len(tokens), 1 + k)
        assert lp.token_ids[:, 0].tolist() == tokens
        expected = raw[rows].gather(1, torch.from_numpy(lp.token_ids).long())
        assert torch.allclose(torch.from_numpy(lp.logprobs), expected, atol=1e-5, rtol=0)
        assert lp.token_ids[:, 1:].tolist() == raw[rows].topk(k).indices.tolist()
        chosen = raw[rows, tokens]
        assert lp.ranks.tolist() == ((raw[rows] > chosen[:, None]).sum(-1) + 1).tolist()


def test_logits_and_states_are_left_untouched() -> None:
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    states = [state(repetition_penalty=1.5, output=(4,)), state(min_tokens=3, top_k=3)]
    verify(logits, states, [[4, 4], [1]])
    assert torch.equal(logits, before)
    assert states[0].output_token_ids == [4] and list(states[0].output_ids) == [4]
    assert states[1].output_token_ids == []


def test_rows_that_do_not_match_the_proposals_are_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        verify(torch.zeros(3, VOCAB), [state()], [[1, 2, 3]])
    with pytest.raises(ValueError, match="states"):
        verify(torch.zeros(1, VOCAB), [state(), state()], [[]])
    with pytest.raises(ValueError, match="proposed token ids"):
        verify(torch.zeros(2, VOCAB), [state()], [[VOCAB]])


def test_a_state_ahead_counts_the_tokens_and_leaves_the_state_alone() -> None:
    s = state(frequency_penalty=1.0, output=(4, 5))
    view = s.ahead([6, 4])
    assert view.output_token_ids == [4, 5, 6, 4]
    assert view.output_ids.tolist() == [4, 5, 6, 4]
    assert s.output_token_ids == [4, 5] and s.output_ids.tolist() == [4, 5]
    view.append(7)
    assert view.output_ids.tolist() == [4, 5, 6, 4, 7]
    assert s.output_ids.tolist() == [4, 5]
    assert view.generator is s.generator and view.params is s.params
