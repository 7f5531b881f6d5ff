"""The draft-free proposers under prompts and outputs chosen to make them slow or large: each
runs on the engine core's thread for every step of every speculating request, so what one
request costs there it costs every other. Work is counted, never timed."""

from __future__ import annotations

import json

import pytest

from triode.actors.config import EngineArgs
from triode.actors.core.speculation.config import MAX_SPEC_FACTOR, SpeculativeConfig
from triode.actors.core.speculation.suffix import (
    MAX_OCCURRENCES,
    SEED_N,
    GlobalSource,
    SuffixProposer,
)


def suffix_config(**knobs) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", num_speculative_tokens=8, **knobs)


def every_match_length(depth: int, k: int, reps: int) -> list[int]:
    """A history in which the last `depth` tokens' suffixes of every length from SEED_N up
    occurred, each after its own token (so each occurrence matches exactly that long), each
    followed by the same k tokens but for one in ten: every match length is its own set of
    occurrences with its own path, and no path is certain enough to cut the others short."""
    tail = list(range(1000, 1000 + depth))
    tokens: list[int] = []
    unique = 5000
    for r in range(reps):
        for n in range(SEED_N, depth):
            unique += 1
            tokens += [unique, *tail[-n:]]
            if (r * depth + n) % 10 == 0:
                tokens += [900, *range(901, 901 + k)]
            else:
                tokens += list(range(800, 800 + k))
    return [*tokens, 7, *tail]


@pytest.mark.parametrize(("depth", "k"), [(24, 8), (64, 32)])
def test_a_path_for_every_match_length_stays_within_the_bound_whatever_the_history(
    depth: int, k: int
):
    examined = []
    for reps in (1, 4):  # the most recent MAX_OCCURRENCES occurrences, then four times as many
        p = SuffixProposer(
            suffix_config(
                suffix_decoding_max_tree_depth=depth, suffix_decoding_max_cached_requests=0
            )
        )
        p.start("r", every_match_length(depth, k, reps * -(-MAX_OCCURRENCES // (depth - SEED_N))))
        assert p.propose("r", k) == list(range(800, 800 + k))
        examined.append(p.last_examined)
    # the prompt does reach the many-paths case: more than one pass over the occurrences
    assert examined[0] > MAX_OCCURRENCES * (depth - SEED_N)
    assert max(examined) <= p.examined_bound(k)
    assert examined[1] <= examined[0] * 1.01  # four times the history, the same work


def test_a_path_for_every_match_length_in_recent_outputs_stays_within_the_bound():
    p = SuffixProposer(suffix_config())
    history = every_match_length(24, 8, 2 * -(-MAX_OCCURRENCES // (24 - SEED_N)))
    p.start("a", [1])
    p.extend("a", history[:-24])
    p.stop("a")
    p.start("b", history[-24:])
    assert p.propose("b", 8) == list(range(800, 808))
    assert MAX_OCCURRENCES * (24 - SEED_N) < p.last_examined <= p.examined_bound(8)


def test_seeding_from_recent_outputs_never_rewrites_the_index():
    # one token fills the ring: its positions are the whole index; the sweep ran at 100 tokens
    source = GlobalSource(max_outputs=10, capacity=64)
    number = source.open()
    source.append(number, [7] * 100)
    source.append(number, [7] * 10)
    stored = len(source.last[7])
    assert stored == 74  # 64 live positions and the 10 overwritten since the sweep
    # the 64 live positions, while the index keeps its overwritten head for the sweep: dropping
    # it here would move every position of the list at every proposal
    assert source.seed(7).tolist() == list(range(46, 110))
    assert source.seed((7,) * SEED_N).tolist() == list(range(46, 110))
    assert len(source.last[7]) == stored
    source.append(number, [7] * 54)  # the next sweep
    assert len(source.last[7]) == 64
    assert source.seed(7).tolist() == list(range(100, 164))[-MAX_OCCURRENCES:]


def test_finished_requests_keep_their_output_but_nothing_else():
    p = SuffixProposer(suffix_config(suffix_decoding_max_cached_requests=1_000_000))
    for i in range(3):
        p.start(f"running{i}", [1])
        p.extend(f"running{i}", [2, 3])
    for i in range(500):
        p.start(f"r{i}", [1])
        p.extend(f"r{i}", [10_000 + i, 20_000 + i])
        p.stop(f"r{i}")
        p.stop(f"r{i}")
    cache = p._global
    assert cache is not None
    # bookkeeping for the running outputs alone, not one entry per request the cache holds
    assert len(cache.tails) == len(cache.ends) == 3
    p.start("probe", [5, 10_123])
    assert p.propose("probe", 8) == [20_123]  # a finished output still proposes
    p.extend("running1", [4])  # a running one still grows
    p.start("probe2", [6, 3])
    assert p.propose("probe2", 8) == [4]


@pytest.mark.parametrize("factor", [MAX_SPEC_FACTOR + 1, 1e300, 1e307, float("inf")])
def test_a_spec_factor_past_its_bound_is_refused_by_name(factor: float):
    value = {"method": "suffix", "num_speculative_tokens": 2}
    value["suffix_decoding_max_spec_factor"] = factor
    with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor"):
        EngineArgs(speculative_config=value)
    if factor != float("inf"):  # JSON has no infinity
        with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor"):
            EngineArgs(speculative_config=json.dumps(value))


def test_the_largest_spec_factor_proposes_what_any_larger_one_would():
    p = SuffixProposer(suffix_config(suffix_decoding_max_spec_factor=MAX_SPEC_FACTOR))
    p.start("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 1])
    # a one-token match may propose all it is asked for
    assert p.propose("r", 8) == [2, 3, 4, 5, 6, 7, 8, 9]
