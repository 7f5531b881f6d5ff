"""Prompt lookup (`NgramProposer`) on hand-made sequences and against a brute-force reference."""

from __future__ import annotations

import random

import pytest

from triode.actors.core.speculation.config import SpeculativeConfig
from triode.actors.core.speculation.ngram import MAX_CANDIDATES, NgramProposer
from triode.actors.core.speculation.proposer import make_proposer
from triode.actors.core.speculation.suffix import SuffixProposer


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n in [min_n, max_n] whose suffix occurred earlier; among those occurrences the
    most recent with k tokens after it, else the earliest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        found = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if found:
            whole = [s for s in found if length - (s + n) >= k]
            start = whole[-1] if whole else found[0]
            return tokens[start + n : start + n + k]
    return []


def proposer(prompt: list[int], min_n: int = 2, max_n: int = 4) -> NgramProposer:
    p = NgramProposer(min_n, max_n)
    p.start("r", prompt)
    return p


def test_copy_of_a_passage_proposes_its_continuation():
    passage = [10, 11, 12, 13, 14, 15, 16, 17]
    p = proposer([1, 2, *passage, 3, 4, *passage[:4]])
    assert p.propose("r", 3) == [14, 15, 16]


def test_no_match_proposes_nothing():
    assert proposer([1, 2, 3, 4, 5, 6]).propose("r", 5) == []


def test_max_tokens_is_honoured_and_the_proposal_stops_at_the_sequence_end():
    p = proposer([7, 8, 1, 2, 3, 7, 8])
    assert p.propose("r", 2) == [1, 2]
    assert p.propose("r", 10) == [1, 2, 3, 7, 8]
    assert p.propose("r", 0) == []


def test_min_n_is_honoured():
    # the last two tokens occurred before, but min_n asks for three
    assert proposer([5, 1, 2, 9, 6, 1, 2], min_n=3, max_n=4).propose("r", 3) == []
    assert proposer([5, 1, 2, 9, 6, 1, 2], min_n=2, max_n=4).propose("r", 3) == [9, 6, 1]


def test_max_n_caps_the_match_so_the_most_recent_occurrence_wins():
    # "1 2 3" matches at the first occurrence, "2 3" at both; with max_n=2 the recent one wins
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert proposer(tokens, min_n=2, max_n=3).propose("r", 1) == [40]
    assert proposer(tokens, min_n=2, max_n=2).propose("r", 1) == [50]


def test_extend_after_start_finds_matches_in_the_output():
    p = proposer([1, 2, 3, 4, 5])
    assert p.propose("r", 2) == []
    p.extend("r", [9])
    p.extend("r", [3, 4])
    assert p.propose("r", 2) == [5, 9]


def test_stop_frees_the_request_and_is_idempotent():
    p = proposer([1, 2, 1, 2])
    p.stop("r")
    p.stop("r")
    p.stop("never-started")
    with pytest.raises(KeyError):
        p.propose("r", 1)
    p.start("r", [3])  # the id can be used again
    assert p.propose("r", 1) == []


def test_starting_a_running_request_again_is_refused():
    p = proposer([1])
    with pytest.raises(ValueError):
        p.start("r", [1])


@pytest.mark.parametrize("seed", range(6))
def test_matches_a_brute_force_reference(seed: int):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 6)
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
    p = proposer(list(tokens), min_n, max_n)
    for _ in range(120):
        k = rng.randint(1, 6)
        assert p.propose("r", k) == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n)
        step = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3]))]
        p.extend("r", step)
        tokens += step


@pytest.mark.parametrize("min_n,max_n", [(1, 8), (3, 3)])
def test_a_long_repetition_examines_a_bounded_number_of_candidates(min_n: int, max_n: int):
    p = proposer([7] * 20_000, min_n, max_n)
    assert p.propose("r", 4) == [7] * 4  # a run proposes a whole run, not the one token left
    assert p.last_candidates == MAX_CANDIDATES
    # a periodic sequence over three tokens: its last min_n tokens occur hundreds of times
    rng = random.Random(0)
    block = [rng.randrange(3) for _ in range(997)]
    q = proposer((block * 21)[:20_000], min_n, max_n)
    assert q.propose("r", 3) == reference((block * 21)[:20_000], min_n, max_n, 3)
    assert 0 < q.last_candidates <= MAX_CANDIDATES


def test_make_proposer_follows_the_method():
    ngram = make_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert isinstance(ngram, NgramProposer)
    assert (ngram.min_n, ngram.max_n) == (5, 5)
    suffix = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=3))
    assert isinstance(suffix, SuffixProposer)
