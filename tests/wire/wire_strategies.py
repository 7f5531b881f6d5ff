"""Hypothesis strategies for valid wire messages (the structural equality check the tests
use is `triode.fuzz.harnesses.wire.assert_wire_equal`, shared with the wire fuzz harness).

Test modules in this folder import it as `wire_strategies` (pytest puts the folder on sys.path);
the name is prefixed so that it cannot shadow a helper of another test folder.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from triode.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SamplingParams,
    SchedulerStats,
    TensorHandle,
    UtilityCall,
    UtilityOutput,
)
from triode.wire.tensor_ipc import NAME_PREFIX

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
MAX_SEED = 2**63 - 1

token_ids = st.integers(0, 2**31 - 1)  # TokenId: what a vocabulary index fits in
# Every int msgpack can carry.
wire_ints = st.integers(INT64_MIN, UINT64_MAX)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)

# What an `Any` field carries: msgpack's own types, with str map keys.
any_values = st.recursive(
    st.none()
    | st.booleans()
    | wire_ints
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
any_dicts = st.dictionaries(st.text(max_size=12), any_values, max_size=4)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 2**31))
    min_tokens = draw(st.integers(0, 2**31 if max_tokens is None else max_tokens))
    return SamplingParams(
        n=draw(st.integers(1, 128)),
        temperature=draw(st.floats(min_value=0, max_value=2.0**100)),
        top_p=draw(st.floats(min_value=0, max_value=1, exclude_min=True)),
        top_k=draw(st.integers(0, INT64_MAX)),
        min_p=draw(st.floats(min_value=0, max_value=1)),
        seed=draw(st.none() | st.integers(-MAX_SEED, MAX_SEED)),
        presence_penalty=draw(st.floats(min_value=-2, max_value=2)),
        frequency_penalty=draw(st.floats(min_value=-2, max_value=2)),
        repetition_penalty=draw(st.floats(min_value=2.0**-100, max_value=2.0**100)),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=4)),
        stop_token_ids=draw(st.lists(token_ids, max_size=4)),
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)),
        logit_bias=draw(
            st.none()
            | st.dictionaries(token_ids, st.floats(min_value=-100, max_value=100), max_size=4)
        ),
        allowed_token_ids=draw(st.none() | st.lists(token_ids, min_size=1, max_size=4)),
        skip_special_tokens=draw(st.booleans()),
        spaces_between_special_tokens=draw(st.booleans()),
    )


@st.composite
def tensor_handles(draw: st.DrawFn) -> TensorHandle:
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int64", "bool"]))
    shape = tuple(draw(st.lists(st.integers(1, 64), min_size=0, max_size=3)))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "bool": 1}[dtype]
    name = NAME_PREFIX + draw(st.binary(min_size=16, max_size=16)).hex()
    return TensorHandle(name, dtype, shape, math.prod(shape) * itemsize)


engine_core_requests = st.builds(
    EngineCoreRequest,
    request_id=st.text(min_size=1, max_size=16),
    prompt_token_ids=st.lists(token_ids, min_size=1, max_size=32),
    sampling_params=sampling_params(),
    eos_token_id=st.none() | token_ids,
    arrival_time=finite_floats,
    client_index=st.integers(0, 2**16 - 1),
    priority=st.integers(INT64_MIN, INT64_MAX),
    kv_transfer_params=st.none() | any_dicts,
    prompt_embeds=st.none() | tensor_handles(),
)


def random_array(seed: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random bits: every float32 pattern (NaNs with payloads, infinities, -0.0) can occur."""
    dtype_ = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype_).reshape(shape)


@st.composite
def logprobs(draw: st.DrawFn, max_positions: int = 40, max_k: int = 8) -> Logprobs:
    """Shapes range from empty through inline (< 256 B) to aux-frame sized arrays.

    Contents are seeded random bits rather than hypothesis arrays: far faster to generate, and
    the codec treats every bit pattern alike.
    """
    positions = draw(st.integers(0, max_positions))
    width = 1 + draw(st.integers(0, max_k))
    seed = draw(st.integers(0, 2**32 - 1))
    return Logprobs(
        token_ids=random_array(seed, "int32", (positions, width)),
        logprobs=random_array(seed + 1, "float32", (positions, width)),
        ranks=random_array(seed + 2, "int32", (positions,)),
    )


engine_core_outputs_one = st.builds(
    EngineCoreOutput,
    request_id=st.text(max_size=16),
    new_token_ids=st.lists(token_ids, max_size=8),
    finish_reason=st.none() | st.sampled_from(FinishReason),
    stop_reason=st.none() | st.integers(0, 2**32) | st.text(max_size=8),
    new_logprobs=st.none() | logprobs(),
    new_prompt_logprobs=st.none() | logprobs(),
    kv_transfer_params=st.none() | any_dicts,
    num_cached_tokens=st.integers(0, 2**31),
)

scheduler_stats = st.builds(
    SchedulerStats,
    num_running_reqs=st.integers(0, 2**31),
    num_waiting_reqs=st.integers(0, 2**31),
    kv_cache_usage=st.floats(min_value=0, max_value=1),
    num_free_blocks=st.integers(0, 2**31),
    num_total_blocks=st.integers(0, 2**31),
    prefix_cache_queries=st.integers(0, INT64_MAX),
    prefix_cache_hits=st.integers(0, INT64_MAX),
    num_preemptions=st.integers(0, INT64_MAX),
)

utility_outputs = st.builds(
    UtilityOutput,
    call_id=st.integers(0, INT64_MAX),
    failure_message=st.none() | st.text(max_size=16),
    result=any_values,
)

engine_core_outputs = st.builds(
    EngineCoreOutputs,
    engine_index=st.integers(0, 2**16),
    outputs=st.lists(engine_core_outputs_one, max_size=3),
    scheduler_stats=st.none() | scheduler_stats,
    utility_output=st.none() | utility_outputs,
    finished_requests=st.none() | st.lists(st.text(max_size=8), max_size=4),
    seq=st.integers(0, INT64_MAX),
    timestamp=finite_floats,
)

utility_calls = st.builds(
    UtilityCall,
    call_id=st.integers(0, INT64_MAX),
    method=st.text(max_size=24),
    args=st.lists(any_values, max_size=4),
    client_index=st.integers(0, 2**16 - 1),
)

abort_payloads = st.lists(st.text(max_size=16), max_size=8)
