"""A request's `n` sequences get their own parameters, which the engine core always accepts."""

from __future__ import annotations

import pytest

from triode.actors.generate_call import split_params, with_eos_ids
from triode.wire import (
    Encoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    SamplingParams,
    encode_input,
)

MAX_SEED = 2**63 - 1


def test_each_sequence_has_n_1_and_the_next_seed() -> None:
    params = split_params(SamplingParams(n=3, seed=5, temperature=0.5))

    assert [(p.n, p.seed, p.temperature) for p in params] == [(1, 5, 0.5), (1, 6, 0.5), (1, 7, 0.5)]


def test_unseeded_sequences_stay_unseeded() -> None:
    assert [p.seed for p in split_params(SamplingParams(n=2))] == [None, None]


@pytest.mark.parametrize("seed", [MAX_SEED, MAX_SEED - 1, -MAX_SEED])
def test_seeds_at_the_top_of_the_range_wrap_and_cross_the_wire(seed: int) -> None:
    # seed + i used to overflow the range: ValueError, and a 500 for n > 1 at the edge.
    params = split_params(SamplingParams(n=128, seed=seed))

    seeds = [p.seed for p in params]
    assert len(set(seeds)) == 128
    assert all(s is not None and -MAX_SEED <= s <= MAX_SEED for s in seeds)
    decoder = InputDecoder()
    for p in params:
        request = EngineCoreRequest("r", [1], p)
        frames = encode_input(Encoder(), EngineCoreRequestType.ADD_REQUEST, request)
        _, decoded = decoder.decode([bytes(f) for f in frames])
        assert isinstance(decoded, EngineCoreRequest) and decoded.sampling_params.seed == p.seed


def test_the_models_other_eos_ids_join_the_stop_ids_unless_eos_is_ignored() -> None:
    params = SamplingParams(stop_token_ids=[9, 4])
    assert with_eos_ids(params, [4, 7]).stop_token_ids == [9, 4, 7]
    assert with_eos_ids(params, []) is params
    ignoring = SamplingParams(ignore_eos=True, stop_token_ids=[9])
    assert with_eos_ids(ignoring, [7]).stop_token_ids == [9]


def test_engine_process_allocator_and_openmp_settings_yield_to_the_users() -> None:
    from triode.actors.model_env import _malloc_env, _openmp_env

    assert _malloc_env({}) == {
        "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    }
    assert _malloc_env({"MALLOC_TRIM_THRESHOLD_": "0"}) == {}
    assert _malloc_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}
    assert _openmp_env({}) == {"GOMP_SPINCOUNT": "10000"}
    assert _openmp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
