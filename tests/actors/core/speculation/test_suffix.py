"""Suffix decoding (`SuffixProposer`): its two sources, its limits, and a brute-force reference."""

from __future__ import annotations

import random

import pytest

from triode.actors.core.speculation.config import SpeculativeConfig
from triode.actors.core.speculation.suffix import MAX_OCCURRENCES, GlobalSource, SuffixProposer


def config(**knobs) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", num_speculative_tokens=8, **knobs)


def reference(tokens: list[int], depth: int, factor: float, min_prob: float, k: int) -> list[int]:
    """The local source alone, by scanning the whole sequence for every match length."""
    context = tokens[-depth:]
    best: tuple[float, int, list[int]] = (0.0, 0, [])
    for m in range(1, len(context)):
        pattern = context[-m:]
        ends = [e for e in range(m - 1, len(tokens)) if tokens[e - m + 1 : e + 1] == pattern]
        if not ends:
            break
        limit = max(0, min(k, int(m * factor + 1e-6), depth - m))
        prob, out, score = 1.0, [], 0.0
        while len(out) < limit:
            following = [tokens[e + 1] for e in ends if e + 1 < len(tokens)]
            if not following:
                break
            top = max(following.count(t) for t in following)
            token = next(t for t in reversed(following) if following.count(t) == top)
            prob *= top / len(ends)
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            ends = [e + 1 for e in ends if e + 1 < len(tokens) and tokens[e + 1] == token]
        if out and (score, m) > best[:2]:
            best = (score, m, out)
    return best[2]


def test_the_local_source_proposes_the_continuation_of_a_repeated_passage():
    p = SuffixProposer(config())
    p.start("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5])
    # a 5-token match proposes at most 5 tokens (max_spec_factor 1)
    assert p.propose("r", 8) == [6, 7, 8, 9, 10]
    p.extend("r", [6, 7])
    assert p.propose("r", 8) == [8, 9, 10, 11, 1, 2, 3]
    assert p.propose("r", 2) == [8, 9]


def test_no_match_proposes_nothing():
    p = SuffixProposer(config())
    p.start("r", [1, 2, 3, 4])
    assert p.propose("r", 8) == []


def test_the_global_source_proposes_from_a_previous_requests_output():
    p = SuffixProposer(config())
    p.start("a", [50, 51])
    p.extend("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    p.stop("a")
    p.start("b", [99, 3, 4, 5])
    assert p.propose("b", 8) == [6, 7, 8]


def test_a_running_requests_output_is_already_in_the_global_source():
    p = SuffixProposer(config())
    p.start("a", [50])
    p.extend("a", [1, 2, 3, 4, 5, 6])
    p.start("b", [60, 2, 3])
    assert p.propose("b", 8) == [4, 5]


def test_no_global_source_when_no_requests_are_cached():
    p = SuffixProposer(config(suffix_decoding_max_cached_requests=0))
    p.start("a", [50])
    p.extend("a", [1, 2, 3, 4, 5, 6])
    p.stop("a")
    p.start("b", [60, 2, 3])
    assert p.propose("b", 8) == []


def test_outputs_past_max_cached_requests_are_evicted_oldest_first():
    p = SuffixProposer(config(suffix_decoding_max_cached_requests=2))
    for i, output in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]):
        p.start(f"r{i}", [100 + i])
        p.extend(f"r{i}", output)
        p.stop(f"r{i}")
    # r0's output went when r2 started; r1's goes when the probe starts
    p.start("probe", [1, 2, 6, 9, 10])
    assert p.propose("probe", 8) == [11, 12]
    p.stop("probe")
    for tokens in ([200, 1, 2], [200, 5, 6]):
        p.start("probe", tokens)
        assert p.propose("probe", 8) == []
        p.stop("probe")


def test_min_token_prob_cuts_the_path_where_continuations_diverge():
    # "1 2 3" went on to 4 then to 5, 6 or 7: after 4 the best continuation has probability 1/3
    outputs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7]]

    def proposal(min_prob: float) -> list[int]:
        p = SuffixProposer(config(suffix_decoding_min_token_prob=min_prob))
        for i, output in enumerate(outputs):
            p.start(f"r{i}", [100 + i])
            p.extend(f"r{i}", output)
            p.stop(f"r{i}")
        p.start("probe", [9, 1, 2, 3])
        return p.propose("probe", 8)

    assert proposal(0.5) == [4]
    assert proposal(0.3) == [4, 7]  # ties go to the most recent continuation


def test_max_spec_factor_limits_the_proposal_by_the_match_length():
    def proposal(factor: float) -> list[int]:
        p = SuffixProposer(config(suffix_decoding_max_spec_factor=factor))
        p.start("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 1, 2])
        return p.propose("r", 8)

    assert proposal(1.0) == [3, 4]
    assert proposal(2.0) == [3, 4, 5, 6]
    assert proposal(0.5) == [3]


def test_stop_frees_the_request_and_keeps_its_output():
    p = SuffixProposer(config())
    p.start("r", [1, 2, 3])
    p.extend("r", [4, 5])
    p.stop("r")
    p.stop("r")
    p.stop("never-started")
    with pytest.raises(KeyError):
        p.propose("r", 1)
    with pytest.raises(KeyError):
        p.extend("r", [1])
    p.start("r", [9, 4])
    assert p.propose("r", 8) == [5]


@pytest.mark.parametrize("seed", range(6))
def test_the_local_source_matches_a_brute_force_reference(seed: int):
    rng = random.Random(seed)
    depth = rng.choice([3, 6, 24])
    factor = rng.choice([0.5, 1.0, 3.0])
    min_prob = rng.choice([0.0, 0.1, 0.4])
    vocab = rng.choice([2, 3, 8])
    cfg = config(
        suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob,
    )
    p = SuffixProposer(cfg)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
    p.start("r", tokens)
    for _ in range(80):
        k = rng.randint(1, 8)
        expected = reference(tokens, depth, factor, min_prob, k)
        assert p.propose("r", k) == expected, (tokens, depth, factor, min_prob, k)
        step = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2]))]
        p.extend("r", step)
        tokens += step


def test_adversarial_histories_touch_a_bounded_number_of_positions():
    p = SuffixProposer(config())
    p.start("same", [7] * 20_000)
    p.extend("same", [7] * 100)
    assert p.propose("same", 8) == [7] * 8
    assert 0 < p.last_examined <= p.examined_bound(8)
    # a random walk over two tokens: every short match recurs thousands of times
    rng = random.Random(1)
    walk = [rng.randrange(2) for _ in range(20_000)]
    p.start("walk", walk)
    p.extend("walk", walk[:3000])
    assert len(p.propose("walk", 8)) <= 8
    assert 0 < p.last_examined <= p.examined_bound(8)
    # over fifty tokens each 4-token window is nearly unique: the copy is found
    text = [rng.randrange(50) for _ in range(20_000)]
    p.start("text", text)
    p.extend("text", text[:3000])
    assert p.propose("text", 8) == text[3000:3008]
    assert 0 < p.last_examined <= p.examined_bound(8)
    assert p.examined_bound(8) < 20 * 20_000  # independent of the history, and below quadratic


def test_the_global_source_keeps_at_most_its_capacity_of_tokens():
    source = GlobalSource(max_outputs=10, capacity=64)
    number = source.open()
    source.append(number, list(range(1000)))
    assert list(source.seed(999)) == [999]
    assert len(source.seed(10)) == 0  # overwritten
    assert sum(len(v) for v in source.last.values()) <= 2 * 64
    assert source.follow(990, 20) == list(range(991, 1000))
    # a match runs back to the ring's oldest token and no further
    reverse = list(range(999, -1, -1))
    assert source.match_lengths(source.seed(999), reverse, 1, 100).tolist() == [64]


def test_seeds_draw_on_the_most_recent_occurrences():
    source = GlobalSource(max_outputs=10, capacity=1 << 16)
    number = source.open()
    source.append(number, [5] * (3 * MAX_OCCURRENCES))
    ends = source.seed(5)
    assert len(ends) == MAX_OCCURRENCES
    assert int(ends[-1]) == 3 * MAX_OCCURRENCES - 1
