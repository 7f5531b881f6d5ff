"""The benchmark's messages (a tokenized request, a decode step's outputs) and its codec case:
`triode.wire`'s Encoder and Decoder against pickle.
"""

from __future__ import annotations

import pickle
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..codec import Decoder, Encoder
from ..messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)
from .report import CODEC, Result

CODEC_TARGET = 3.0  # pickle time / msgspec time


def make_request(prompt_len: int, rng: random.Random) -> EngineCoreRequest:
    """A tokenized request with `prompt_len` random token ids below 50,000."""
    return EngineCoreRequest(
        request_id="req-123",
        prompt_token_ids=[rng.randrange(50_000) for _ in range(prompt_len)],
        sampling_params=SamplingParams(
            temperature=0.7, top_p=0.95, max_tokens=256, seed=1234, stop=["</s>"]
        ),
        eos_token_id=2,
        arrival_time=1_700_000_000.0,
    )


def make_outputs(batch: int, rng: random.Random) -> EngineCoreOutputs:
    """One decode step's outputs for `batch` requests, one new token each."""
    return EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(request_id=f"req-{i}", new_token_ids=[rng.randrange(50_000)])
            for i in range(batch)
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=batch, kv_cache_usage=0.5),
        seq=42,
        timestamp=1_700_000_000.0,
    )


def time_per_call(fn: Callable[[], object], *, repeats: int, min_time: float) -> float:
    """Median over `repeats` timed loops of `fn`'s time per call, in microseconds.

    The loop count doubles until one loop takes `min_time` seconds. GC stays enabled, as in a
    server.
    """
    loops = 1
    while _timed_loop(fn, loops) < min_time:
        loops *= 2
    return statistics.median(_timed_loop(fn, loops) / loops * 1e6 for _ in range(repeats))


def _timed_loop(fn: Callable[[], object], loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return time.perf_counter() - start


def bench_codec(msg: Any, name: str, *, repeats: int = 7, min_time: float = 0.05) -> Result:
    """Encode+decode of `msg` with one reused Encoder/Decoder against pickle's highest protocol."""
    encoder, decoder = Encoder(), Decoder(type(msg))

    def wire_round_trip() -> object:
        return decoder.decode(encoder.encode(msg))

    def pickle_round_trip() -> object:
        return pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    if wire_round_trip() != msg or pickle_round_trip() != msg:
        raise RuntimeError(f"{name} does not survive an encode/decode round trip")
    wire_us = time_per_call(wire_round_trip, repeats=repeats, min_time=min_time)
    pickle_us = time_per_call(pickle_round_trip, repeats=repeats, min_time=min_time)
    return Result(CODEC, name, wire_us, pickle_us, pickle_us / wire_us, CODEC_TARGET)
