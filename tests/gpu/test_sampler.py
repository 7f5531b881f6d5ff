"""The sampler: each sampling parameter's effect, seeded reproducibility, and logprobs."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from triode.gpu.logits_processing import process_logits
from triode.gpu.sampler import Sampler, compute_logprobs
from triode.gpu.sampling_state import SamplingState
from triode.wire.messages import SamplingParams

VOCAB = 64
EOS = 5


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    # Unseeded rows draw from torch's global generator; fixing it keeps the statistical tests
    # deterministic.
    torch.manual_seed(1234)


def state(prompt: list[int] | None = None, vocab: int = VOCAB, **params: Any) -> SamplingState:
    return SamplingState(SamplingParams(**params), prompt or [1, 2, 3], EOS, vocab)


def sample_many(logits_row: torch.Tensor, rows: int, **params: Any) -> collections.Counter[int]:
    """Sample `rows` times from one row of logits, in one batch of independent unseeded rows."""
    vocab = logits_row.shape[0]
    states = [state(vocab=vocab, **params) for _ in range(rows)]
    out = Sampler()(logits_row.expand(rows, vocab), states)
    return collections.Counter(out.token_ids)


def chi_square(counts: collections.Counter[int], probs: torch.Tensor) -> float:
    total = sum(counts.values())
    expected = probs * total
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float32)
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def test_greedy_is_argmax_of_logits() -> None:
    logits = torch.randn(8, VOCAB)
    out = Sampler()(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_one_equals_greedy_even_at_temperature_one() -> None:
    logits = torch.randn(16, VOCAB)
    out = Sampler()(logits, [state(temperature=1.0, top_k=1) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_mix_with_sampled_rows() -> None:
    logits = torch.randn(6, VOCAB)
    states = [
        state(temperature=0.0 if i % 2 else 1.0, top_p=0.9 if i % 3 else 1.0) for i in range(6)
    ]
    out = Sampler()(logits, states)
    assert [out.token_ids[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("params", "dtype"),
    [
        ({"temperature": 1.0}, torch.float32),
        ({"temperature": 0.8, "top_p": 0.9}, torch.float32),
        # bfloat16 logits tie a lot: candidates' order differs between topk and sort
        ({"temperature": 0.8, "top_p": 0.9}, torch.bfloat16),
        ({"temperature": 1.2, "top_k": 20, "min_p": 0.01}, torch.float32),
        ({"temperature": 1.0, "presence_penalty": 1.0, "repetition_penalty": 1.2}, torch.float32),
    ],
    ids=["plain", "top_p", "top_p_bf16", "top_k_min_p", "penalties"],
)
def test_seeded_tokens_repeat_whatever_else_is_in_the_batch(
    params: dict[str, Any], dtype: torch.dtype
) -> None:
    vocab = 2048  # wide enough that candidate lists start from a topk, not a sort
    steps = [(torch.randn(5, vocab) * scale).to(dtype) for _ in range(2) for scale in (1.0, 4.0)]

    def run(batch_of: int, position: int) -> list[int]:
        seeded = state(vocab=vocab, seed=42, **params)
        others = [
            state(vocab=vocab, top_p=0.5),
            state(vocab=vocab, seed=7, top_k=600, top_p=0.8),  # its candidates come from a sort
            state(vocab=vocab),
            state(vocab=vocab, temperature=0.0),
        ][: batch_of - 1]
        states = [*others[:position], seeded, *others[position:]]
        tokens = []
        for logits in steps:
            rows = [*range(1, position + 1), 0, *range(position + 1, batch_of)]
            out = Sampler()(logits[rows], states)
            for s, t in zip(states, out.token_ids, strict=True):
                s.append(t)
            tokens.append(out.token_ids[position])
        return tokens

    alone = run(1, 0)
    assert run(1, 0) == alone
    assert run(5, 0) == alone
    assert run(5, 3) == alone
    assert run(3, 2) == alone


def test_seeded_tokens_ignore_how_ties_are_ordered() -> None:
    # Alone the row's candidates come from a topk; beside a wide top-k row, from a full sort.
    # The two order the 64 tied best tokens differently.
    vocab = 4096
    logits = torch.full((2, vocab), -5.0)
    logits[:, torch.randperm(vocab)[:64]] = 5.0

    def run(companion: bool) -> list[int]:
        states = [state(vocab=vocab, seed=3, top_p=0.9), state(vocab=vocab, top_k=2000)]
        rows = 2 if companion else 1
        return [Sampler()(logits[:rows], states[:rows]).token_ids[0] for _ in range(8)]

    assert run(companion=True) == run(companion=False)


def test_different_seeds_draw_different_tokens() -> None:
    logits = torch.zeros(40, 1000)  # uniform: two seeds agree on a step with probability 1/1000
    out = Sampler()(logits, [state(vocab=1000, seed=seed) for seed in range(40)])
    assert len(set(out.token_ids)) >= 35


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    counts = sample_many(logits, 4000, temperature=temperature)
    # 7 degrees of freedom: chi-square > 30 has probability ~1e-4
    assert chi_square(counts, torch.softmax(logits / temperature, dim=-1)) < 30


def test_top_k_samples_the_renormalized_k_best() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    counts = sample_many(logits, 4000, temperature=0.7, top_k=3)
    expected = torch.softmax(logits / 0.7, dim=-1)
    expected[[2, 3, 4, 5, 7]] = 0
    assert set(counts) == {0, 1, 6}
    assert chi_square(counts, expected / expected.sum()) < 20


def test_top_k_beyond_the_vocabulary_keeps_everything() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    counts = sample_many(logits, 4000, top_k=1000)
    assert chi_square(counts, torch.softmax(logits, dim=-1)) < 30


def test_top_p_samples_exactly_the_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05 on shuffled ids: mass before token 2 is 0.8 >= 0.7
    probs = torch.zeros(VOCAB)
    probs[[9, 4, 30, 17]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = sample_many(probs.log(), 3000, top_p=0.7)
    assert set(counts) == {9, 4}
    assert chi_square(counts, torch.where(probs >= 0.3, probs / 0.8, 0.0)) < 15


def test_top_p_finds_a_nucleus_wider_than_the_first_candidates() -> None:
    vocab = 5000
    logits = torch.full((vocab,), -20.0)
    wide = torch.randperm(vocab)[:300]
    logits[wide] = 5.0 + torch.linspace(0, 0.1, 300)  # ~all the mass in 300 near-equal tokens
    counts = sample_many(logits, 1500, top_p=0.99)
    assert set(counts) <= set(wide.tolist())
    assert len(counts) > 280


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.zeros(VOCAB)
    probs[[3, 8, 13, 21]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    for extra in ({}, {"top_k": 10}):
        counts = sample_many(probs.log(), 3000, min_p=0.4, **extra)  # floor 0.16
        assert set(counts) == {3, 8, 13}


def process(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    return process_logits(logits.clone(), states)


def test_penalties_follow_the_hf_and_openai_formulas() -> None:
    logits = torch.randn(4, VOCAB) * 3
    params = [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 0.7, "frequency_penalty": -0.3},
        {"repetition_penalty": 0.8, "presence_penalty": -1.0, "frequency_penalty": 0.5},
        {},
    ]
    prompts = [[1, 2, 2, 40], [3, 4], [5, 6, 7], [8]]
    outputs = [[2, 9, 9], [4, 10, 10, 10, 11], [7, 7, 12], [8, 8]]
    states = [state(p, **kw) for p, kw in zip(prompts, params, strict=True)]
    for s, out in zip(states, outputs, strict=True):
        for t in out:
            s.append(t)

    expected = logits.clone()
    for row, (kw, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        rep = kw.get("repetition_penalty", 1.0)
        for t in set(prompt) | set(out):
            v = expected[row, t]
            expected[row, t] = v / rep if v > 0 else v * rep
        for t, count in collections.Counter(out).items():
            expected[row, t] -= kw.get("frequency_penalty", 0.0) * count
            expected[row, t] -= kw.get("presence_penalty", 0.0)

    got = process(logits, states)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_logit_bias_adds_to_the_named_tokens() -> None:
    logits = torch.randn(2, VOCAB)
    states = [state(logit_bias={3: 2.5, 60: -100.0}), state()]
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 60] -= 100.0
    assert torch.equal(process(logits, states), expected)

    weakest = int(logits[0].argmin())
    out = Sampler()(logits[:1], [state(temperature=0.0, logit_bias={weakest: 100.0})])
    assert out.token_ids == [weakest]


def test_allowed_token_ids_are_never_violated() -> None:
    allowed = [3, 7, 11]
    logits = torch.randn(VOCAB) * 5
    counts = sample_many(logits, 2000, temperature=2.0, allowed_token_ids=allowed)
    assert set(counts) == set(allowed)

    out = Sampler()(logits[None], [state(temperature=0.0, allowed_token_ids=allowed)])
    assert out.token_ids == [allowed[int(logits[allowed].argmax())]]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_holds_back_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 6] = 9.0  # a stop token id
    logits[0, 20] = 8.0
    s = state(temperature=0.0, min_tokens=2, stop_token_ids=[6], ignore_eos=ignore_eos)
    tokens = []
    for _ in range(3):
        tokens.append(Sampler()(logits, [s]).token_ids[0])
        s.append(tokens[-1])
    # ignore_eos: EOS does not stop the request, so min_tokens has no reason to hold it back
    assert tokens == ([EOS, EOS, EOS] if ignore_eos else [20, 20, EOS])


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(3, VOCAB) * 2
    # allowed_token_ids and the bias force an unlikely token: its logprob and rank stay raw
    forced = int(logits[0].argsort()[10])
    states = [
        state(temperature=0.0, logprobs=3, allowed_token_ids=[forced], logit_bias={forced: 5.0}),
        state(seed=1, logprobs=5),
        state(temperature=0.0),
    ]
    out = Sampler()(logits, states)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] == forced
    assert out.logprobs[2] is None
    for row, k in ((0, 3), (1, 5)):
        lp = out.logprobs[row]
        assert lp is not None
        chosen = out.token_ids[row]
        assert lp.token_ids.shape == lp.logprobs.shape == (1, 1 + k)
        assert lp.token_ids.dtype.name == "int32" and lp.ranks.dtype.name == "int32"
        assert lp.logprobs.dtype.name == "float32"
        assert lp.token_ids[0, 0] == chosen
        top = raw[row].topk(k)
        assert lp.token_ids[0, 1:].tolist() == top.indices.tolist()
        got = torch.from_numpy(lp.logprobs[0])
        assert torch.allclose(got, raw[row, lp.token_ids[0].tolist()], atol=1e-5, rtol=0)
        assert torch.all(got[1:-1] >= got[2:])
        assert lp.ranks.tolist() == [int((raw[row] > raw[row, chosen]).sum()) + 1]
        if row == 0:
            assert lp.ranks.tolist() == [VOCAB - 10]


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    logits = torch.randn(2, VOCAB)
    out = Sampler()(logits, [state(logprobs=0), state(temperature=0.0, logprobs=0)])
    for row in range(2):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.token_ids.tolist() == [[out.token_ids[row]]]
        expected = torch.log_softmax(logits[row], dim=-1)[out.token_ids[row]]
        assert abs(float(lp.logprobs[0, 0]) - float(expected)) < 1e-5


def test_compute_logprobs_ranks_targets_across_positions() -> None:
    logits = torch.randn(4, VOCAB)
    order = logits.argsort(dim=-1, descending=True)
    targets = order[torch.arange(4), torch.tensor([0, 1, 5, VOCAB - 1])]
    lp = compute_logprobs(logits, targets, 2)
    assert lp.ranks.tolist() == [1, 2, 6, VOCAB]
    assert lp.token_ids[:, 0].tolist() == targets.tolist()
    assert lp.token_ids[:, 1:].tolist() == order[:, :2].tolist()
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, torch.from_numpy(lp.token_ids).long())
    assert torch.allclose(torch.from_numpy(lp.logprobs), expected, atol=1e-5, rtol=0)


def test_bfloat16_logits_sample_and_give_float32_logprobs() -> None:
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    states = [state(temperature=0.0, logprobs=2), state(top_p=0.9, logprobs=1), state(), state()]
    out = Sampler()(logits, states)
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert all(0 <= t < VOCAB for t in out.token_ids)
    lp = out.logprobs[0]
    assert lp is not None and lp.logprobs.dtype.name == "float32"
    expected = torch.log_softmax(logits[0].float(), dim=-1)[out.token_ids[0]]
    assert abs(float(lp.logprobs[0, 0]) - float(expected)) < 1e-5


def test_sampler_leaves_the_logits_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    states = [
        state(repetition_penalty=2.0, logit_bias={1: 3.0}),
        state(allowed_token_ids=[1, 2], top_k=2),
        state(min_tokens=3, min_p=0.1),
    ]
    Sampler()(logits, states)
    Sampler()(logits, [state(), state(temperature=0.0), state(top_p=0.5)])
    assert torch.equal(logits, before)


def test_token_ids_outside_the_vocabulary_are_rejected() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        state(allowed_token_ids=[VOCAB])
    with pytest.raises(ValueError, match="logit_bias"):
        state(logit_bias={VOCAB + 3: 1.0})


def test_stop_ids_outside_the_vocabulary_are_ignored_by_min_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    s = state(temperature=0.0, min_tokens=1, stop_token_ids=[VOCAB + 1])
    assert Sampler()(logits, [s]).token_ids != [EOS]
