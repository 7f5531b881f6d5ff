"""Round-trips: every valid message decodes back to itself, arrays and tensors included."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import wire_strategies as ws
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triode.fuzz.harnesses.wire import arrays_in, assert_wire_equal
from triode.wire import (
    DEFAULT_AUX_THRESHOLD,
    Decoder,
    Encoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    Logprobs,
    OutputDecoder,
    SamplingParams,
    UtilityCall,
    encode_input,
    encode_output,
)

ROUNDTRIP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THRESHOLDS = st.sampled_from([DEFAULT_AUX_THRESHOLD, 0, 1, 64, 2**31])

# One decoder per type, reused across examples as in production: state must not leak.
DECODERS: dict[Any, Decoder[Any]] = {
    t: Decoder(t) for t in (SamplingParams, EngineCoreRequest, EngineCoreOutputs, UtilityCall)
}
INPUT_DECODER = InputDecoder()
OUTPUT_DECODER = OutputDecoder()


def received(frames: list[Any]) -> list[bytes]:
    """What a peer gets: copies, sharing no memory with the sender's objects."""
    return [bytes(f) for f in frames]


def expected_aux_count(msg: Any, threshold: int) -> int:
    return sum(a.nbytes >= threshold for a in arrays_in(msg))


@ROUNDTRIP
@given(ws.sampling_params())
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    frames = Encoder().encode(params)

    assert len(frames) == 1
    assert_wire_equal(DECODERS[SamplingParams].decode(received(frames)), params)


@ROUNDTRIP
@given(ws.engine_core_requests)
def test_engine_core_request_round_trips_through_input_framing(request: EngineCoreRequest) -> None:
    frames = encode_input(Encoder(), EngineCoreRequestType.ADD_REQUEST, request)

    kind, decoded = INPUT_DECODER.decode(received(frames))

    assert kind is EngineCoreRequestType.ADD_REQUEST
    assert_wire_equal(decoded, request)
    assert_wire_equal(DECODERS[EngineCoreRequest].decode(received(frames[1:])), request)


@ROUNDTRIP
@given(ws.utility_calls)
def test_utility_call_round_trips_through_input_framing(call: UtilityCall) -> None:
    frames = encode_input(Encoder(), EngineCoreRequestType.UTILITY, call)

    kind, decoded = INPUT_DECODER.decode(received(frames))

    assert kind is EngineCoreRequestType.UTILITY
    assert_wire_equal(decoded, call)


@ROUNDTRIP
@given(ws.abort_payloads)
def test_abort_ids_round_trip_through_input_framing(request_ids: list[str]) -> None:
    frames = encode_input(Encoder(), EngineCoreRequestType.ABORT_REQUEST, request_ids)

    assert INPUT_DECODER.decode(received(frames)) == (
        EngineCoreRequestType.ABORT_REQUEST,
        request_ids,
    )


@ROUNDTRIP
@given(ws.engine_core_outputs, st.integers(0, 2**16 - 1), THRESHOLDS)
def test_engine_core_outputs_round_trip_with_aux_frames(
    outputs: EngineCoreOutputs, client: int, threshold: int
) -> None:
    frames = encode_output(Encoder(aux_threshold=threshold), client, outputs)

    assert len(frames) - 2 == expected_aux_count(outputs, threshold)
    decoded_client, decoded = OUTPUT_DECODER.decode(received(frames))
    assert decoded_client == client
    assert_wire_equal(decoded, outputs)


@ROUNDTRIP
@given(ws.logprobs(max_positions=80, max_k=15))
def test_logprobs_round_trip_inline_and_out_of_band(logprobs: Logprobs) -> None:
    frames = Encoder().encode(logprobs)

    assert len(frames) - 1 == expected_aux_count(logprobs, DEFAULT_AUX_THRESHOLD)
    assert_wire_equal(Decoder(Logprobs).decode(received(frames)), logprobs)


@pytest.mark.parametrize(
    ("positions", "aux_frames"),
    [(0, 0), (1, 0), (7, 0), (8, 2), (64, 3)],
)
def test_aux_threshold_is_256_bytes(positions: int, aux_frames: int) -> None:
    # [positions, 8] int32/float32 is 32 * positions bytes; ranks is 4 * positions.
    logprobs = Logprobs(
        token_ids=np.arange(positions * 8, dtype=np.int32).reshape(positions, 8),
        logprobs=np.linspace(-9, 0, positions * 8, dtype=np.float32).reshape(positions, 8),
        ranks=np.arange(positions, dtype=np.int32),
    )

    frames = Encoder().encode(logprobs)

    assert len(frames) == 1 + aux_frames
    assert all(len(memoryview(f).cast("B")) >= 256 for f in frames[1:])
    assert_wire_equal(Decoder(Logprobs).decode(received(frames)), logprobs)


NUMPY_DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (40, 3), (2, 3, 70)])
def test_numpy_array_round_trips_for_every_wire_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    array = rng.integers(0, 100, size=shape).astype(dtype)

    frames = Encoder().encode(array)

    assert len(frames) == (2 if array.nbytes >= DEFAULT_AUX_THRESHOLD else 1)
    assert_wire_equal(Decoder(np.ndarray).decode(received(frames)), array)


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.arange(12, dtype=">i4").reshape(3, 4), id="big-endian"),
        pytest.param(np.array(7, dtype=">f8"), id="big-endian-0d"),
        pytest.param(np.arange(200, dtype=np.float32).reshape(10, 20).T, id="transposed"),
        pytest.param(np.arange(20, dtype=np.int16)[::3], id="strided"),
    ],
)
def test_non_native_layouts_decode_to_equal_native_arrays(array: np.ndarray) -> None:
    decoded = Decoder(np.ndarray).decode(received(Encoder().encode(array)))

    assert decoded.shape == array.shape
    assert decoded.dtype == array.dtype.newbyteorder("=")
    assert np.array_equal(decoded, array)


def test_aux_frame_aliases_the_array_without_a_copy() -> None:
    array = np.arange(1000, dtype=np.float32)

    _, aux = Encoder().encode(array)

    assert np.shares_memory(np.frombuffer(aux, dtype=np.float32), array)


class TensorBox(msgspec.Struct, array_like=True):
    tensor: torch.Tensor


TENSORS = [
    pytest.param(torch.linspace(-1, 1, 6).reshape(2, 3), id="float32-small"),
    pytest.param(torch.linspace(-1, 1, 4096).reshape(64, 64), id="float32-large"),
    pytest.param(torch.linspace(-3, 3, 10, dtype=torch.bfloat16), id="bfloat16-small"),
    pytest.param(torch.linspace(-3, 3, 1000, dtype=torch.bfloat16), id="bfloat16-large"),
    pytest.param(torch.arange(-5, 5, dtype=torch.int64), id="int64-small"),
    pytest.param(torch.arange(10**12, 10**12 + 300, dtype=torch.int64), id="int64-large"),
    pytest.param(torch.tensor([True, False, True]), id="bool-small"),
    pytest.param(torch.arange(999) % 3 == 0, id="bool-large"),
    pytest.param(torch.tensor(2.5), id="float32-0d"),
    pytest.param(torch.tensor(True), id="bool-0d"),
    pytest.param(torch.tensor(-7, dtype=torch.int64), id="int64-0d"),
    pytest.param(torch.empty(0), id="float32-empty"),
    pytest.param(torch.empty(4, 0, dtype=torch.bfloat16), id="bfloat16-empty"),
    pytest.param(torch.empty(0, dtype=torch.bool), id="bool-empty"),
    pytest.param(torch.arange(600, dtype=torch.int64).reshape(20, 30).T, id="int64-transposed"),
    pytest.param(torch.ones(100, requires_grad=True), id="requires-grad"),
]


@pytest.mark.parametrize("tensor", TENSORS)
def test_torch_tensor_round_trips_inline_or_as_aux_frame(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()

    frames = Encoder().encode(TensorBox(tensor))
    decoded = Decoder(TensorBox).decode(received(frames)).tensor

    if nbytes >= DEFAULT_AUX_THRESHOLD:
        assert len(frames) == 2
        assert len(memoryview(frames[1]).cast("B")) == nbytes
    else:
        assert len(frames) == 1
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor.detach())


def test_large_tensor_aux_frame_holds_the_raw_little_endian_bytes() -> None:
    tensor = torch.arange(100, dtype=torch.int32)

    body, aux = Encoder().encode(TensorBox(tensor))

    assert msgspec.msgpack.decode(body) == [["int32", [100], 0]]
    assert bytes(aux) == np.arange(100, dtype="<i4").tobytes()


def test_importing_the_wire_package_and_coding_arrays_does_not_import_torch() -> None:
    script = (
        "import sys, numpy as np, triode.wire as w\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "lp = w.Logprobs(np.zeros((9, 9), np.int32), np.zeros((9, 9), np.float32),"
        " np.zeros(9, np.int32))\n"
        "frames = w.encode_output(w.Encoder(), 0, w.EngineCoreOutputs("
        "outputs=[w.EngineCoreOutput('r', new_logprobs=lp)]))\n"
        "assert len(frames) == 4\n"
        "w.OutputDecoder().decode([bytes(f) for f in frames])\n"
        "assert 'torch' not in sys.modules, 'codec'\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
