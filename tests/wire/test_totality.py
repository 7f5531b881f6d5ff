"""Every decoder is total: any frames decode to a valid message or raise ProtocolError.

A "valid message" is checked by re-encoding what was decoded and decoding it again: a decoder
that let through something its own encoder or validation rejects fails the test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import wire_strategies as ws
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triode.fuzz.harnesses.wire import assert_wire_equal
from triode.wire import (
    ControlMessage,
    Decoder,
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    Hello,
    InputDecoder,
    Logprobs,
    OutputDecoder,
    ProtocolError,
    SamplingParams,
    SchedulerStats,
    UtilityCall,
    UtilityOutput,
    encode_input,
    encode_output,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Each example of these builds a whole EngineCoreOutputs: fewer of them.
STRUCTURAL = settings(FUZZ, max_examples=100)

ENCODER = Encoder()


class TensorBox(msgspec.Struct, array_like=True):
    tensor: torch.Tensor


def _typed(type_: Any) -> tuple[Callable[[list[Any]], Any], Callable[[Any], list[Any]]]:
    return Decoder(type_).decode, ENCODER.encode


def _input_reencode(decoded: tuple[EngineCoreRequestType, Any]) -> list[Any]:
    return encode_input(ENCODER, *decoded)


def _output_reencode(decoded: tuple[int, EngineCoreOutputs]) -> list[Any]:
    return encode_output(ENCODER, *decoded)


# name -> (decode, re-encode what decode returned)
DECODERS: dict[str, tuple[Callable[[list[Any]], Any], Callable[[Any], list[Any]]]] = {
    "SamplingParams": _typed(SamplingParams),
    "EngineCoreRequest": _typed(EngineCoreRequest),
    "EngineCoreOutput": _typed(EngineCoreOutput),
    "EngineCoreOutputs": _typed(EngineCoreOutputs),
    "Logprobs": _typed(Logprobs),
    "SchedulerStats": _typed(SchedulerStats),
    "UtilityCall": _typed(UtilityCall),
    "UtilityOutput": _typed(UtilityOutput),
    "abort-ids": _typed(list[str]),
    "ControlMessage": _typed(ControlMessage),
    "ndarray": _typed(np.ndarray),
    "tensor": _typed(TensorBox),
    "input": (InputDecoder().decode, _input_reencode),
    "output": (OutputDecoder().decode, _output_reencode),
}


def decodes_or_raises_protocol_error(name: str, frames: list[bytes]) -> bool:
    """True if `frames` decoded (to a valid message), False if they raised ProtocolError.

    Any other exception propagates and fails the calling test.
    """
    decode, reencode = DECODERS[name]
    try:
        decoded = decode(frames)
    except ProtocolError:
        return False
    try:
        again = decode([bytes(f) for f in reencode(decoded)])
    except ProtocolError as exc:
        raise AssertionError(f"{name} accepted {decoded!r}, which does not round-trip") from exc
    assert_wire_equal(again, decoded)
    return True


def raises_protocol_error(name: str, frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        DECODERS[name][0](frames)


# Random bytes.


@FUZZ
@given(st.binary(max_size=300))
def test_random_single_frame_decodes_or_raises_protocol_error_in_every_decoder(
    frame: bytes,
) -> None:
    for name in DECODERS:
        decodes_or_raises_protocol_error(name, [frame])


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_random_frames_decode_or_raise_protocol_error_in_every_decoder(
    frames: list[bytes],
) -> None:
    for name in DECODERS:
        decodes_or_raises_protocol_error(name, frames)


@FUZZ
@given(
    st.sampled_from([t.value for t in EngineCoreRequestType]),
    st.lists(st.binary(max_size=300), min_size=0, max_size=3),
)
def test_random_frames_after_a_valid_type_byte_decode_or_raise(
    head: bytes, rest: list[bytes]
) -> None:
    decodes_or_raises_protocol_error("input", [head, *rest])


@FUZZ
@given(st.binary(min_size=2, max_size=2), st.lists(st.binary(max_size=300), max_size=3))
def test_random_frames_after_a_valid_topic_decode_or_raise(topic: bytes, rest: list[bytes]) -> None:
    decodes_or_raises_protocol_error("output", [topic, *rest])


# Well-formed msgpack of the wrong shape: exercises validation rather than the parser.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | ws.wire_ints
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(["int32", "float32", "bool", "bfloat16", "hello", "config", "ready"]),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=4) | st.sampled_from(["type"]), inner, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(msgpack_values, st.lists(st.binary(max_size=64), max_size=2))
def test_arbitrary_msgpack_values_decode_or_raise_protocol_error_in_every_decoder(
    value: Any, aux: list[bytes]
) -> None:
    frames = [msgspec.msgpack.encode(value), *aux]
    for name in DECODERS:
        head = {"input": [b"\x02"], "output": [b"\x00\x00"]}.get(name, [])
        decodes_or_raises_protocol_error(name, [*head, *frames])


# Mutations of valid encodings.

valid_inputs = st.one_of(
    st.tuples(st.just(EngineCoreRequestType.ADD_REQUEST), ws.engine_core_requests),
    st.tuples(st.just(EngineCoreRequestType.ABORT_REQUEST), ws.abort_payloads),
    st.tuples(st.just(EngineCoreRequestType.UTILITY), ws.utility_calls),
)


@st.composite
def mutated(draw: st.DrawFn, frames: list[Any]) -> list[bytes]:
    out = [bytearray(bytes(f)) for f in frames]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(
            st.sampled_from(
                ["flip", "set", "insert", "delete", "truncate", "drop", "duplicate", "swap"]
            )
        )
        i = draw(st.integers(0, len(out) - 1))
        frame = out[i]
        pos = draw(st.integers(0, len(frame)))
        if op == "flip" and pos < len(frame):
            frame[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and pos < len(frame):
            frame[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del frame[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del frame[pos:]
        elif op == "drop" and len(out) > 1:
            del out[i]
        elif op == "duplicate":
            out.insert(i, bytearray(frame))
        elif op == "swap":
            j = draw(st.integers(0, len(out) - 1))
            out[i], out[j] = out[j], out[i]
    return [bytes(f) for f in out]


@FUZZ
@given(valid_inputs, st.data())
def test_mutated_input_frames_decode_or_raise_protocol_error(
    valid: tuple[EngineCoreRequestType, Any], data: st.DataObject
) -> None:
    frames = data.draw(mutated(encode_input(ENCODER, *valid)))
    decodes_or_raises_protocol_error("input", frames)


@FUZZ
@given(ws.engine_core_outputs, st.sampled_from([0, 64, 256]), st.data())
def test_mutated_output_frames_decode_or_raise_protocol_error(
    outputs: EngineCoreOutputs, threshold: int, data: st.DataObject
) -> None:
    frames = data.draw(mutated(encode_output(Encoder(aux_threshold=threshold), 7, outputs)))
    decodes_or_raises_protocol_error("output", frames)


@FUZZ
@given(
    st.sampled_from([ws.engine_core_requests, ws.utility_calls, ws.engine_core_outputs]), st.data()
)
def test_mutated_bodies_decode_or_raise_protocol_error_in_every_decoder(
    messages: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    frames = data.draw(mutated(Encoder(aux_threshold=64).encode(data.draw(messages))))
    for name in DECODERS:
        decodes_or_raises_protocol_error(name, frames)


# Structural corruptions of aux frames: always a ProtocolError.


@st.composite
def outputs_with_aux(draw: st.DrawFn) -> list[bytes]:
    """Output frames `[topic, body, *aux]` with at least two aux frames."""
    big = draw(ws.logprobs(max_positions=20, max_k=12).filter(lambda lp: lp.token_ids.size >= 64))
    outputs = draw(ws.engine_core_outputs)
    outputs.outputs.append(EngineCoreOutput(request_id="big", new_prompt_logprobs=big))
    frames = [bytes(f) for f in encode_output(ENCODER, 1, outputs)]
    assert len(frames) >= 4
    return frames


@STRUCTURAL
@given(outputs_with_aux(), st.data())
def test_missing_aux_frame_is_a_protocol_error(frames: list[bytes], data: st.DataObject) -> None:
    del frames[data.draw(st.integers(2, len(frames) - 1))]
    raises_protocol_error("output", frames)


@STRUCTURAL
@given(outputs_with_aux(), st.data())
def test_extra_aux_frame_is_a_protocol_error(frames: list[bytes], data: st.DataObject) -> None:
    extra = data.draw(st.binary(max_size=600) | st.sampled_from(frames[2:]))
    frames.insert(data.draw(st.integers(2, len(frames))), extra)
    raises_protocol_error("output", frames)


@STRUCTURAL
@given(outputs_with_aux(), st.data())
def test_aux_frame_of_the_wrong_size_is_a_protocol_error(
    frames: list[bytes], data: st.DataObject
) -> None:
    i = data.draw(st.integers(2, len(frames) - 1))
    size = data.draw(st.integers(0, 2 * len(frames[i])).filter(lambda n: n != len(frames[i])))
    frames[i] = bytes(size)
    raises_protocol_error("output", frames)


@STRUCTURAL
@given(outputs_with_aux())
def test_valid_frames_with_aux_decode(frames: list[bytes]) -> None:
    # The control for the three tests above: unmutated, the same frames decode.
    assert decodes_or_raises_protocol_error("output", frames)


# Hand-built array encodings. A Logprobs of 8 positions x 9 (288 B token_ids and logprobs).

TOKENS = ["int32", [8, 9], 0]
LOGPROBS = ["float32", [8, 9], 1]
RANKS = ["int32", [8], bytes(32)]
AUX = [bytes(288), bytes(288)]


def output_frames(
    tokens: Any = TOKENS, logprobs: Any = LOGPROBS, ranks: Any = RANKS
) -> list[bytes]:
    body = msgspec.msgpack.encode([0, [["r", [], None, None, [tokens, logprobs, ranks]]]])
    return [b"\x00\x01", body]


def test_hand_built_logprobs_decode() -> None:
    client, outputs = OutputDecoder().decode([*output_frames(), *AUX])

    assert client == 1
    logprobs = outputs.outputs[0].new_logprobs
    assert logprobs is not None
    assert logprobs.token_ids.shape == (8, 9)
    assert logprobs.logprobs.dtype == np.float32


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([*output_frames(tokens=["int32", [8, 9], 2]), *AUX], "aux index past the end"),
        ([*output_frames(tokens=["int32", [8, 9], -1]), *AUX], "negative aux index"),
        ([*output_frames(tokens=["int32", [8, 9], 2**64 - 1]), *AUX], "huge aux index"),
        ([*output_frames(logprobs=["float32", [8, 9], 0]), AUX[0]], "one aux frame used twice"),
        ([*output_frames(logprobs=["float32", [8, 9], 0]), *AUX], "index repeated, one unused"),
        ([*output_frames(tokens=["int32", [8, 9], True]), *AUX], "bool as aux index"),
        ([*output_frames(tokens=["int32", [8, 9], 0.0]), *AUX], "float as aux index"),
        ([*output_frames(tokens=["float8", [8, 9], 0]), *AUX], "unknown dtype"),
        ([*output_frames(tokens=["object", [8, 9], 0]), *AUX], "object dtype"),
        ([*output_frames(tokens=["bfloat16", [8, 18], 0]), *AUX], "dtype numpy lacks"),
        ([*output_frames(tokens=[7, [8, 9], 0]), *AUX], "dtype not a string"),
        ([*output_frames(tokens=["int32", [-8, -9], 0]), *AUX], "negative shape"),
        ([*output_frames(tokens=["int32", [-1, -288], 0]), *AUX], "negative shape, right size"),
        ([*output_frames(tokens=["int32", [2**40, 2**40], 0]), *AUX], "huge shape"),
        ([*output_frames(tokens=["int32", [2**64 - 1, 0], 0]), *AUX], "huge shape, no data"),
        ([*output_frames(tokens=["int32", [0, 2**62], 0]), *AUX], "huge empty shape"),
        ([*output_frames(tokens=["int32", [1] * 33, b"\0" * 4]), AUX[1]], "33 dimensions"),
        ([*output_frames(tokens=["int32", [8.0, 9], 0]), *AUX], "float dimension"),
        ([*output_frames(tokens=["int32", [True, 72], 0]), *AUX], "bool dimension"),
        ([*output_frames(tokens=["int32", "8x9", 0]), *AUX], "shape not a list"),
        ([*output_frames(tokens=["int32", [8, 9], "data"]), *AUX], "data a string"),
        ([*output_frames(tokens=["int32", [8, 9], None]), *AUX], "data nil"),
        ([*output_frames(tokens=["int32", [8, 9]]), *AUX], "two parts"),
        ([*output_frames(tokens=["int32", [8, 9], 0, 0]), *AUX], "four parts"),
        ([*output_frames(tokens={"dtype": "int32"}), *AUX], "a map"),
        ([*output_frames(ranks=["int32", [8], bytes(31)]), *AUX], "inline data one short"),
        ([*output_frames(ranks=["int32", [8], bytes(33)]), *AUX], "inline data one long"),
        ([*output_frames(ranks=["int32", [7], bytes(28)]), *AUX], "shapes disagree"),
        ([*output_frames(), AUX[0], AUX[1][:-1]], "aux frame one short"),
        ([*output_frames(), *AUX, b""], "empty extra aux frame"),
        ([*output_frames(), AUX[0]], "aux frame missing"),
        (output_frames(), "no aux frames"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_corrupt_array_encoding_is_a_protocol_error(frames: list[bytes], why: str) -> None:
    raises_protocol_error("output", frames)


ARRAY_CASES = [
    # (parts, aux frames, decodes as ndarray, decodes as tensor)
    (["int32", [1] * 32, bytes(4)], [], True, True),
    (["int32", [1] * 33, bytes(4)], [], False, False),
    (["int32", [2, 3], 0], [bytes(24)], True, True),
    (["int32", [True, 2], bytes(8)], [], False, False),
    (["int32", [2], bytes(9)], [], False, False),
    (["int32", [2], bytes(12)], [], False, False),
    (["int32", [2], 0], [bytes(12)], False, False),
    (["int32", [2], 0], [bytes(7)], False, False),
    (["int32", [0], b""], [], True, True),
    (["int32", [0], 0], [b""], True, True),
    (["int32", [0], 0], [b"", b""], False, False),
    (["bfloat16", [2], bytes(4)], [], False, True),
    (["float8", [2], bytes(2)], [], False, False),
    (["complex64", [1], bytes(8)], [], False, False),
    (["INT32", [1], bytes(4)], [], False, False),
]


@pytest.mark.parametrize(("parts", "aux", "as_ndarray", "as_tensor"), ARRAY_CASES, ids=repr)
def test_array_encoding_decodes_exactly_when_well_formed(
    parts: list[Any], aux: list[bytes], as_ndarray: bool, as_tensor: bool
) -> None:
    body = msgspec.msgpack.encode(parts)

    assert decodes_or_raises_protocol_error("ndarray", [body, *aux]) is as_ndarray
    assert decodes_or_raises_protocol_error("tensor", [msgspec.msgpack.encode([parts]), *aux]) is (
        as_tensor
    )


ABORT_BODY = msgspec.msgpack.encode(["r"])


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\x00"],
        [b"", ABORT_BODY],
        [b"\x03", ABORT_BODY],
        [b"\xff", ABORT_BODY],
        [b"\x00\x00", ABORT_BODY],
        [b"\x01\x01", ABORT_BODY],
    ],
    ids=["no-frames", "type-only", "empty-type", "type-3", "type-ff", "two-byte-type", "0101"],
)
def test_bad_type_frame_is_a_protocol_error(frames: list[bytes]) -> None:
    raises_protocol_error("input", frames)


@pytest.mark.parametrize(
    "topic", [b"", b"\x00", b"\x00\x00\x00", b"\x00" * 1000], ids=["0", "1", "3", "1000"]
)
def test_topic_that_is_not_two_bytes_is_a_protocol_error(topic: bytes) -> None:
    body = ENCODER.encode(EngineCoreOutputs())[0]
    raises_protocol_error("output", [topic, body])
    assert OutputDecoder().decode([b"\x00\x00", body])[0] == 0


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_no_frames_or_an_empty_frame_is_a_protocol_error(name: str) -> None:
    raises_protocol_error(name, [])
    raises_protocol_error(name, [b""])


# Field values that the constructors reject must be rejected on decode too.

DEFAULT_SAMPLING = msgspec.structs.asdict(SamplingParams())


def raw_sampling(**fields: Any) -> list[Any]:
    """SamplingParams as the wire list, built by hand so that __post_init__ never runs."""
    values = {**DEFAULT_SAMPLING, **fields}
    return [values[name] for name in SamplingParams.__struct_fields__]


DEFAULT_REQUEST = {
    "request_id": "r",
    "prompt_token_ids": [1, 2],
    "eos_token_id": None,
    "arrival_time": 0.0,
    "client_index": 0,
    "priority": 0,
    "kv_transfer_params": None,
    "prompt_embeds": None,
    "cache_salt": None,
    "lora_name": None,
    "pooling_params": None,
}
_SHM = "triode_tensor_" + "ab" * 16


def raw_request(*, sampling: list[Any] | None = None, **fields: Any) -> bytes:
    """EngineCoreRequest as the wire list, built by hand."""
    values = {**DEFAULT_REQUEST, "sampling_params": sampling or raw_sampling(), **fields}
    return msgspec.msgpack.encode([values[name] for name in EngineCoreRequest.__struct_fields__])


INVALID_SAMPLING = [
    {"n": 0},
    {"n": 129},
    {"n": -1},
    {"temperature": -1.0},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"temperature": 1e39},  # finite, but past float32: the sampler's -inf masks turn NaN
    {"top_p": 0.0},
    {"top_p": 2.0},
    {"top_p": float("nan")},
    {"top_k": -1},
    {"min_p": -0.1},
    {"min_p": 1.5},
    {"seed": 2**63},
    {"seed": -(2**63)},
    {"presence_penalty": 2.5},
    {"frequency_penalty": -3.0},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": float("inf")},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
    {"max_tokens": 0},
    {"max_tokens": -5},
    {"min_tokens": -1},
    {"min_tokens": 17},  # > max_tokens (16)
    {"stop": ["ok", ""]},
    {"stop_token_ids": [-1]},
    {"logprobs": 21},
    {"logprobs": -1},
    {"prompt_logprobs": 21},
    {"logit_bias": {-1: 1.0}},
    {"logit_bias": {1: 100.5}},
    {"logit_bias": {1: float("nan")}},
    {"allowed_token_ids": []},
    {"allowed_token_ids": [3, -3]},
    {"n": "1"},
    {"temperature": "hot"},
    {"stop": "stop"},
]


@pytest.mark.parametrize("fields", INVALID_SAMPLING, ids=repr)
def test_invalid_sampling_params_are_a_protocol_error(fields: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(raw_sampling(**fields))

    raises_protocol_error("SamplingParams", [body])
    raises_protocol_error("input", [b"\x00", raw_request(sampling=raw_sampling(**fields))])


def test_hand_built_valid_request_decodes() -> None:
    # The control for the invalid-value tests: the same hand-built lists, valid, decode.
    kind, request = InputDecoder().decode([b"\x00", raw_request(client_index=65535)])

    assert kind is EngineCoreRequestType.ADD_REQUEST
    assert_wire_equal(
        request,
        EngineCoreRequest(
            request_id="r",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(),
            client_index=65535,
        ),
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": ""},
        {"prompt_token_ids": []},
        {"prompt_token_ids": [1, -1]},
        {"client_index": 65536},
        {"client_index": -1},
        {"eos_token_id": "eos"},
        {"kv_transfer_params": [1]},
        {"prompt_embeds": ["psm_cd99894b", "float32", [2, 3], 24]},  # not a tensor's segment
        {"prompt_embeds": ["../" + _SHM, "float32", [2, 3], 24]},
        {"prompt_embeds": [_SHM, "float32", [2, 3], 25]},  # nbytes disagrees with the shape
        {"prompt_embeds": [_SHM, "complex64", [2, 3], 48]},
        {"prompt_embeds": [_SHM, "float32", [2, -3], 24]},
        {"prompt_embeds": [_SHM, "float32", [], 0]},
        {"prompt_embeds": [_SHM, "float32", [1] * 33, 4]},
        {"prompt_embeds": [_SHM, "float32", [1 << 40], 1 << 42]},  # beyond the largest tensor
        {"prompt_embeds": [_SHM, "float32", [2, 3]]},
        {"prompt_embeds": {"shm_name": _SHM}},
        {"lora_name": ""},
        {"lora_name": "a" * 257},
        {"lora_name": 7},
        {"pooling_params": ["generate", 0]},
        {"pooling_params": ["embed", -1]},
        {"pooling_params": ["embed", 2**31]},
    ],
    ids=repr,
)
def test_invalid_request_fields_are_a_protocol_error(fields: dict[str, Any]) -> None:
    raises_protocol_error("input", [b"\x00", raw_request(**fields)])


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("EngineCoreOutput", ["r", [], 9]),  # no FinishReason 9
        ("EngineCoreOutput", ["r", [], 0, 1.5]),  # stop_reason neither int nor str
        ("EngineCoreOutputs", [0, [], None, None, None, "seq"]),
        ("ControlMessage", {"type": "goodbye"}),
        ("ControlMessage", {"type": "hello", "pid": 1}),  # protocol_version missing
        ("ControlMessage", {"protocol_version": 1, "pid": 1}),  # no tag
        ("ControlMessage", ["hello", 1, 1]),
        ("abort-ids", ["r", 1]),
        ("abort-ids", "r"),
    ],
    ids=repr,
)
def test_wrongly_typed_messages_are_a_protocol_error(name: str, value: Any) -> None:
    raises_protocol_error(name, [msgspec.msgpack.encode(value)])


@pytest.mark.parametrize(
    ("tokens", "logprobs", "ranks"),
    [
        (["float64", [1, 1], bytes(8)], ["float32", [1, 1], bytes(4)], ["int32", [1], bytes(4)]),
        (["int32", [1, 1], bytes(4)], ["uint8", [1, 1], bytes(1)], ["int32", [1], bytes(4)]),
        (["int32", [1, 1], bytes(4)], ["float32", [1, 1], bytes(4)], ["bool", [1], bytes(1)]),
    ],
    ids=["float64-token-ids", "uint8-logprobs", "bool-ranks"],
)
def test_logprobs_of_the_wrong_dtype_are_a_protocol_error(
    tokens: list[Any], logprobs: list[Any], ranks: list[Any]
) -> None:
    raises_protocol_error("output", output_frames(tokens, logprobs, ranks))


# Deep nesting: a RecursionError (or a crash) must not escape.

DEPTH = 100_000
NESTED_ARRAYS = b"\x91" * DEPTH + b"\xc0"
NESTED_MAPS = b"\x81\xa1k" * DEPTH + b"\xc0"


@pytest.mark.parametrize("nested", [NESTED_ARRAYS, NESTED_MAPS], ids=["arrays", "maps"])
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_deeply_nested_body_is_a_protocol_error(name: str, nested: bytes) -> None:
    frames = [b"\x00\x00", nested] if name == "output" else [nested]
    if name == "input":
        frames = [b"\x02", nested]
    raises_protocol_error(name, frames)


@pytest.mark.parametrize("nested", [NESTED_ARRAYS, NESTED_MAPS], ids=["arrays", "maps"])
@pytest.mark.parametrize(
    ("name", "prefix"),
    [
        ("UtilityCall", b"\x93\x01\xa1m\x91"),  # [1, "m", [<nested>]]: inside args: list[Any]
        ("UtilityOutput", b"\x93\x01\xc0"),  # [1, nil, <nested>]: the Any result
        ("EngineCoreRequest", b"\x98\xa1r\x91\x01\x90\xc0\x00\x00\x00\x81\xa1k"),  # kv params
        ("ControlMessage", b"\x82\xa4type\xa6config\xa7options\x81\xa1k"),
        ("ControlMessage", b"\x82\xa4type\xa5ready\xa4info\x81\xa1k"),
    ],
    ids=["utility-args", "utility-result", "kv-transfer-params", "config-options", "ready-info"],
)
def test_deep_nesting_inside_an_any_field_is_a_protocol_error(
    name: str, prefix: bytes, nested: bytes
) -> None:
    shallow = prefix + b"\xc0"
    assert decodes_or_raises_protocol_error(name, [shallow])  # the same field, shallow, decodes

    raises_protocol_error(name, [prefix + nested])


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_decoder_works_after_a_protocol_error(name: str) -> None:
    valid = {
        "SamplingParams": SamplingParams(),
        "EngineCoreRequest": EngineCoreRequest("r", [1], SamplingParams()),
        "EngineCoreOutput": EngineCoreOutput("r"),
        "EngineCoreOutputs": EngineCoreOutputs(),
        "Logprobs": Logprobs(
            np.zeros((9, 9), np.int32), np.zeros((9, 9), np.float32), np.zeros(9, np.int32)
        ),
        "SchedulerStats": SchedulerStats(),
        "UtilityCall": UtilityCall(1, "m"),
        "UtilityOutput": UtilityOutput(1),
        "abort-ids": ["r"],
        "ControlMessage": Hello(protocol_version=1, pid=1),
        "ndarray": np.arange(100, dtype=np.int64),
        "tensor": TensorBox(torch.arange(100)),
    }
    if name == "input":
        frames = encode_input(ENCODER, EngineCoreRequestType.ABORT_REQUEST, ["r"])
    elif name == "output":
        frames = encode_output(ENCODER, 2, EngineCoreOutputs(outputs=[EngineCoreOutput("r")]))
    else:
        frames = ENCODER.encode(valid[name])
    frames = [bytes(f) for f in frames]
    raises_protocol_error(name, [*frames, b"unreferenced aux frame"])
    raises_protocol_error(name, [b"\xc1"])

    assert decodes_or_raises_protocol_error(name, frames)
