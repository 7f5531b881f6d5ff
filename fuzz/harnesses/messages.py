"""Valid wire messages, drawn from fuzz bytes, in the value ranges of the wire's property tests
(`tests/wire/wire_strategies.py`): the starting points that the wire harness mutates."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from triode.wire import (
    Config,
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    Error,
    FinishReason,
    Hello,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    Ready,
    RequestStepResult,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    Shutdown,
    TensorHandle,
    UtilityCall,
    UtilityOutput,
    encode_input,
    encode_output,
)
from triode.wire.tensor_ipc import NAME_PREFIX

from .source import ByteSource


def _token(src: ByteSource) -> int:
    return src.int(0, 2**31 - 1) if src.bool() else src.int(0, 300)


def _tokens(src: ByteSource, lo: int, hi: int) -> list[int]:
    return [_token(src) for _ in range(src.int(lo, hi))]


def _finite(src: ByteSource) -> float:
    value = src.float()
    return value if math.isfinite(value) else 0.0


def _any(src: ByteSource, depth: int = 0) -> Any:
    kind = src.byte() % (8 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return src.bool()
    if kind == 2:
        value = src.wide_int()
        return value if -(2**63) <= value < 2**64 else 0
    if kind == 3:
        return src.float()
    if kind == 4:
        return _str(src, 12)
    if kind == 5:
        return src.blob(12)
    if kind == 6:
        return [_any(src, depth + 1) for _ in range(src.int(0, 4))]
    return {_str(src, 8): _any(src, depth + 1) for _ in range(src.int(0, 4))}


def _str(src: ByteSource, size: int) -> str:
    # Valid Unicode: the encoder refuses lone surrogates, and so never sends them.
    return src.text(size).encode("utf-8", "replace").decode()


def sampling_params(src: ByteSource) -> SamplingParams:
    max_tokens = None if src.chance(4) else src.int(1, 2**31)
    return SamplingParams(
        n=src.int(1, 128),
        temperature=min(abs(_finite(src)), 2.0**100),  # the sampler's float32 bound
        top_p=src.choice([1.0, 0.5, 1e-9, 0.999]),
        top_k=src.int(0, 2**63 - 1) if src.chance(8) else src.int(0, 50),
        min_p=src.choice([0.0, 0.05, 1.0]),
        seed=None if src.bool() else src.int(-(2**63) + 1, 2**63 - 1),
        presence_penalty=src.choice([0.0, -2.0, 2.0, 0.5]),
        frequency_penalty=src.choice([0.0, -2.0, 2.0, -0.5]),
        repetition_penalty=src.choice([1.0, 1e-9, 2.0**100, 2.0**-100, 1.2]),
        max_tokens=max_tokens,
        min_tokens=src.int(0, max_tokens if max_tokens is not None else 2**31),
        stop=[_str(src, 8) or "x" for _ in range(src.int(0, 3))],
        stop_token_ids=_tokens(src, 0, 3),
        include_stop_str_in_output=src.bool(),
        ignore_eos=src.bool(),
        logprobs=None if src.bool() else src.int(0, 20),
        prompt_logprobs=None if src.bool() else src.int(0, 20),
        logit_bias=None
        if src.bool()
        else {_token(src): src.choice([-100.0, 0.0, 3.5, 100.0]) for _ in range(src.int(0, 3))},
        allowed_token_ids=None if src.bool() else _tokens(src, 1, 3),
        skip_special_tokens=src.bool(),
        spaces_between_special_tokens=src.bool(),
    )


def engine_core_request(src: ByteSource) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=_str(src, 16) or "r",
        prompt_token_ids=_tokens(src, 1, 40),
        sampling_params=sampling_params(src),
        eos_token_id=None if src.bool() else _token(src),
        arrival_time=_finite(src),
        client_index=src.int(0, 2**16 - 1),
        priority=src.int(-(2**63), 2**63 - 1),
        kv_transfer_params=None if src.bool() else {_str(src, 8): _any(src) for _ in range(2)},
        prompt_embeds=None if src.bool() else tensor_handle(src),
        cache_salt=None if src.bool() else _str(src, 32) or "s",
    )


def tensor_handle(src: ByteSource) -> TensorHandle:
    dtype, itemsize = src.choice([("float32", 4), ("bfloat16", 2), ("float16", 2), ("uint8", 1)])
    shape = tuple(src.int(1, 64) for _ in range(src.int(0, 3)))
    name = NAME_PREFIX + src.take(16).ljust(16, b"\0").hex()
    return TensorHandle(name, dtype, shape, math.prod(shape) * itemsize)


def random_array(src: ByteSource, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random bits for every element: NaNs with payloads, infinities and -0.0 included."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    seed = src.int(0, 2**32 - 1)
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def logprobs(src: ByteSource, max_positions: int = 40) -> Logprobs:
    positions, width = src.int(0, max_positions), 1 + src.int(0, 8)
    return Logprobs(
        token_ids=random_array(src, "int32", (positions, width)),
        logprobs=random_array(src, "float32", (positions, width)),
        ranks=random_array(src, "int32", (positions,)),
    )


def engine_core_output(src: ByteSource) -> EngineCoreOutput:
    stop: int | str | None = src.choice([None, 0, 2**32, "stop"])
    return EngineCoreOutput(
        request_id=_str(src, 16),
        new_token_ids=_tokens(src, 0, 8),
        finish_reason=None if src.bool() else src.choice(list(FinishReason)),
        stop_reason=stop,
        new_logprobs=logprobs(src) if src.chance(3) else None,
        new_prompt_logprobs=logprobs(src) if src.chance(4) else None,
        kv_transfer_params=None if src.bool() else {_str(src, 8): _any(src)},
        num_cached_tokens=src.int(0, 2**31),
    )


def engine_core_outputs(src: ByteSource) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        engine_index=src.int(0, 2**16),
        outputs=[engine_core_output(src) for _ in range(src.int(0, 3))],
        scheduler_stats=None
        if src.bool()
        else SchedulerStats(
            num_running_reqs=src.int(0, 2**31),
            num_waiting_reqs=src.int(0, 2**31),
            kv_cache_usage=src.choice([0.0, 0.5, 1.0]),
            num_free_blocks=src.int(0, 2**31),
            num_total_blocks=src.int(0, 2**31),
            prefix_cache_queries=src.int(0, 2**63 - 1),
            prefix_cache_hits=src.int(0, 2**63 - 1),
            num_preemptions=src.int(0, 2**63 - 1),
        ),
        utility_output=None
        if src.bool()
        else UtilityOutput(src.int(0, 2**63 - 1), src.choice([None, "failed"]), _any(src)),
        finished_requests=None if src.bool() else [_str(src, 8) for _ in range(src.int(0, 4))],
        seq=src.int(0, 2**63 - 1),
        timestamp=_finite(src),
    )


def utility_call(src: ByteSource) -> UtilityCall:
    return UtilityCall(
        call_id=src.int(0, 2**63 - 1),
        method=_str(src, 24),
        args=[_any(src) for _ in range(src.int(0, 4))],
        client_index=src.int(0, 2**16 - 1),
    )


def control_message(src: ByteSource) -> Any:
    kind = src.byte() % 5
    if kind == 0:
        return Hello(
            protocol_version=src.wide_int() % 2**63, pid=src.int(0, 2**22), name=_str(src, 12)
        )
    if kind == 1:
        return Config({_str(src, 8): _str(src, 40) for _ in range(2)}, {"k": _any(src)})
    if kind == 2:
        return Ready(src.int(0, 2**31), src.int(0, 64), src.int(0, 2**20), {"i": _any(src)})
    if kind == 3:
        return Shutdown(_str(src, 12))
    return Error(_str(src, 12), _str(src, 40), _str(src, 80))


def scheduler_output(src: ByteSource) -> SchedulerOutput:
    requests = []
    for _ in range(src.int(0, 3)):
        new = None
        if src.bool():
            embeds_dtype = None if src.bool() else src.choice(["float32", "bfloat16"])
            new = NewRequestData(_tokens(src, 1, 8), sampling_params(src), embeds_dtype)
        requests.append(
            ScheduledRequest(
                _str(src, 8) or "r",
                _tokens(src, 0, 8),
                src.int(0, 2**20),
                _tokens(src, 0, 4),
                src.bool(),
                new,
                None if src.bool() else random_array(src, "float32", (src.int(0, 4), 8)),
            )
        )
    return SchedulerOutput(
        src.int(0, 2**31), requests, [_str(src, 8) for _ in range(src.int(0, 2))]
    )


def model_runner_output(src: ByteSource) -> ModelRunnerOutput:
    results = [
        RequestStepResult(
            _str(src, 8),
            None if src.bool() else _token(src),
            logprobs(src, 1) if src.chance(3) else None,
            logprobs(src) if src.chance(4) else None,
        )
        for _ in range(src.int(0, 3))
    ]
    return ModelRunnerOutput(src.int(0, 2**31), results)


# target -> a valid message for it, as frames
VALID: dict[str, Callable[[ByteSource, Encoder], list[Any]]] = {
    "input": lambda src, enc: encode_input(enc, *_input_payload(src)),
    "output": lambda src, enc: encode_output(enc, src.int(0, 2**16 - 1), engine_core_outputs(src)),
    "control": lambda src, enc: enc.encode(control_message(src)),
    "EngineCoreRequest": lambda src, enc: enc.encode(engine_core_request(src)),
    "EngineCoreOutputs": lambda src, enc: enc.encode(engine_core_outputs(src)),
    "SamplingParams": lambda src, enc: enc.encode(sampling_params(src)),
    "Logprobs": lambda src, enc: enc.encode(logprobs(src)),
    "UtilityCall": lambda src, enc: enc.encode(utility_call(src)),
    "UtilityOutput": lambda src, enc: enc.encode(UtilityOutput(src.int(0, 99), None, _any(src))),
    "abort-ids": lambda src, enc: enc.encode([_str(src, 16) for _ in range(src.int(0, 8))]),
    "SchedulerOutput": lambda src, enc: enc.encode(scheduler_output(src)),
    "ModelRunnerOutput": lambda src, enc: enc.encode(model_runner_output(src)),
    "ndarray": lambda src, enc: enc.encode(
        random_array(src, src.choice(["int32", "float32", "uint8", "int64"]), (src.int(0, 80),))
    ),
}


def _input_payload(src: ByteSource) -> tuple[EngineCoreRequestType, Any]:
    kind = src.choice(list(EngineCoreRequestType))
    if kind is EngineCoreRequestType.ADD_REQUEST:
        return kind, engine_core_request(src)
    if kind is EngineCoreRequestType.ABORT_REQUEST:
        return kind, [_str(src, 16) for _ in range(src.int(0, 8))]
    return kind, utility_call(src)
