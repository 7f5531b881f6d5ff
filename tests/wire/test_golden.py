"""Golden bytes: each message type's encoding is pinned to a literal.

A failure here means the wire format changed. If the change is deliberate, it must stay
append-only (DESIGN §3) or bump PROTOCOL_VERSION; then recompute the constant.

Note that `omit_defaults` has no effect on `array_like` structs (msgspec #720): every field,
defaults included, is on the wire. If a msgspec upgrade starts omitting trailing defaults, these
constants change; older decoders still read such messages (see the evolution tests below).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from triode.fuzz.harnesses.wire import assert_wire_equal
from triode.wire import (
    Config,
    ControlMessage,
    Decoder,
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    Error,
    FinishReason,
    Hello,
    InputDecoder,
    Logprobs,
    OutputDecoder,
    Ready,
    SamplingParams,
    SchedulerStats,
    Shutdown,
    UtilityCall,
    UtilityOutput,
    encode_input,
    encode_output,
    topic_for,
)
from triode.wire.tensor_ipc import TensorHandle

SAMPLING = SamplingParams(
    n=2,
    temperature=0.5,
    top_p=0.75,
    top_k=40,
    seed=7,
    max_tokens=32,
    stop=["\n\n"],
    stop_token_ids=[2],
    logprobs=3,
    logit_bias={5: -1.5},
)
REQUEST = EngineCoreRequest(
    request_id="req-1",
    prompt_token_ids=[1, 15043, 3186],
    sampling_params=SAMPLING,
    eos_token_id=2,
    arrival_time=1.5,
    client_index=3,
    priority=-1,
    kv_transfer_params={"do_remote_prefill": True},
    cache_salt="s1",
    lora_name="ada",
)
DEFAULT_REQUEST = EngineCoreRequest(
    request_id="a", prompt_token_ids=[0], sampling_params=SamplingParams()
)
# only the handle travels; the embeddings stay in shared memory
EMBEDS_REQUEST = EngineCoreRequest(
    request_id="e",
    prompt_token_ids=[0, 0],
    sampling_params=SamplingParams(temperature=0.0),
    prompt_embeds=TensorHandle("triode_tensor_" + "0123456789abcdef" * 2, "bfloat16", (2, 3), 12),
)
SMALL_LOGPROBS = Logprobs(
    token_ids=np.array([[11, 12], [21, 22]], dtype=np.int32),
    logprobs=np.array([[-0.5, -1.0], [-0.25, -2.0]], dtype=np.float32),
    ranks=np.array([1, 2], dtype=np.int32),
)
OUTPUT = EngineCoreOutput(
    request_id="req-1",
    new_token_ids=[42, 43],
    finish_reason=FinishReason.LENGTH,
    stop_reason="###",
    new_logprobs=SMALL_LOGPROBS,
    num_cached_tokens=16,
)
OUTPUTS = EngineCoreOutputs(
    engine_index=1,
    outputs=[OUTPUT, EngineCoreOutput(request_id="req-2", new_token_ids=[7])],
    scheduler_stats=SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        num_free_blocks=96,
        num_total_blocks=128,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_preemptions=1,
    ),
    utility_output=UtilityOutput(call_id=9, failure_message="no", result=[1, "x"]),
    finished_requests=["req-1"],
    seq=5,
    timestamp=2.0,
)
# 8 x 9 int32 and float32 arrays are 288 bytes each: over the aux threshold. ranks (32 B) is not.
BIG_LOGPROBS = Logprobs(
    token_ids=np.arange(72, dtype=np.int32).reshape(8, 9),
    logprobs=np.full((8, 9), -0.5, dtype=np.float32),
    ranks=np.arange(1, 9, dtype=np.int32),
)
BIG_OUTPUTS = EngineCoreOutputs(
    outputs=[EngineCoreOutput(request_id="r", new_prompt_logprobs=BIG_LOGPROBS)], seq=1
)
CALL = UtilityCall(call_id=9, method="reset_prefix_cache", args=[1, "a", None], client_index=3)
HELLO = Hello(protocol_version=1, pid=1234, name="core0")
CONFIG = Config(addresses={"input": "ipc:///tmp/in"}, options={"max_num_seqs": 8})
READY = Ready(num_kv_blocks=512, block_size=16, max_model_len=2048, info={"dtype": "bf16"})
SHUTDOWN = Shutdown(reason="bye")
ERROR = Error(type_name="ValueError", message="bad", traceback="tb")

SAMPLING_BYTES = (
    b"\xdc\x00\x16\x02\xcb?\xe0\x00\x00\x00\x00\x00\x00\xcb?\xe8\x00\x00\x00\x00\x00\x00("
    b"\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x07\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb\x00"
    b"\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00\x00\x00\x00\x00\x00 \x00\x91\xa2\n\n\x91"
    b"\x02\xc2\xc2\x03\xc0\x81\x05\xcb\xbf\xf8\x00\x00\x00\x00\x00\x00\xc0\xc3\xc3\xc0"
)
REQUEST_BYTES = (
    b"\x9c\xa5req-1\x93\x01\xcd:\xc3\xcd\x0cr\xdc\x00\x16\x02\xcb?\xe0\x00\x00\x00\x00\x00"
    b"\x00\xcb?\xe8\x00\x00\x00\x00\x00\x00(\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x07\xcb"
    b"\x00\x00\x00\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00"
    b"\x00\x00\x00\x00\x00 \x00\x91\xa2\n\n\x91\x02\xc2\xc2\x03\xc0\x81\x05\xcb\xbf\xf8"
    b"\x00\x00\x00\x00\x00\x00\xc0\xc3\xc3\xc0\x02\xcb?\xf8\x00\x00\x00\x00\x00\x00\x03"
    b"\xff\x81\xb1do_remote_prefill\xc3\xc0\xa2s1\xa3ada\xc0"
)
DEFAULT_REQUEST_BYTES = (
    b"\x9c\xa1a\x91\x00\xdc\x00\x16\x01\xcb?\xf0\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00\x00"
    b"\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xc0\xcb\x00\x00\x00\x00\x00"
    b"\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00\x00\x00\x00\x00\x00"
    b"\x10\x00\x90\x90\xc2\xc2\xc0\xc0\xc0\xc0\xc3\xc3\xc0\xc0\xcb\x00\x00\x00\x00\x00\x00"
    b"\x00\x00\x00\x00\xc0\xc0\xc0\xc0\xc0"
)
EMBEDS_REQUEST_BYTES = (
    b"\x9c\xa1e\x92\x00\x00\xdc\x00\x16\x01\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0"
    b"\x00\x00\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xc0\xcb\x00\x00\x00"
    b"\x00\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xcb?\xf0\x00\x00\x00\x00"
    b"\x00\x00\x10\x00\x90\x90\xc2\xc2\xc0\xc0\xc0\xc0\xc3\xc3\xc0\xc0\xcb\x00\x00\x00\x00"
    b"\x00\x00\x00\x00\x00\x00\xc0\x94\xd9.triode_tensor_0123456789abcdef0123456789abcdef"
    b"\xa8bfloat16\x92\x02\x03\x0c\xc0\xc0\xc0"
)
OUTPUT_BYTES = (
    b"\x9a\xa5req-1\x92*+\x01\xa3###\x93\x93\xa5int32\x92\x02\x02\xc4\x10\x0b\x00\x00\x00"
    b"\x0c\x00\x00\x00\x15\x00\x00\x00\x16\x00\x00\x00\x93\xa7float32\x92\x02\x02\xc4\x10"
    b"\x00\x00\x00\xbf\x00\x00\x80\xbf\x00\x00\x80\xbe\x00\x00\x00\xc0\x93\xa5int32\x91"
    b"\x02\xc4\x08\x01\x00\x00\x00\x02\x00\x00\x00\xc0\xc0\x10\x00\xc0"
)
OUTPUTS_BYTES = (
    b"\x97\x01\x92\x9a\xa5req-1\x92*+\x01\xa3###\x93\x93\xa5int32\x92\x02\x02\xc4\x10\x0b"
    b"\x00\x00\x00\x0c\x00\x00\x00\x15\x00\x00\x00\x16\x00\x00\x00\x93\xa7float32\x92\x02"
    b"\x02\xc4\x10\x00\x00\x00\xbf\x00\x00\x80\xbf\x00\x00\x80\xbe\x00\x00\x00\xc0\x93\xa5"
    b"int32\x91\x02\xc4\x08\x01\x00\x00\x00\x02\x00\x00\x00\xc0\xc0\x10\x00\xc0\x9a\xa5req"
    b"-2\x91\x07\xc0\xc0\xc0\xc0\xc0\x00\x00\xc0\x9f\x02\x01\xcb?\xd0\x00\x00\x00\x00\x00"
    b"\x00`\xcc\x80\n\x04\x01\x00\x00\x00\x00\x00\x00\x00\x94\t\xa2no\x92\x01\xa1x\xc0\x91"
    b"\xa5req-1\x05\xcb@\x00\x00\x00\x00\x00\x00\x00"
)
# token_ids and logprobs are aux frames 0 and 1, referenced by index; ranks is inline bin.
BIG_OUTPUTS_BYTES = (
    b"\x97\x00\x91\x9a\xa1r\x90\xc0\xc0\xc0\x93\x93\xa5int32\x92\x08\t\x00\x93\xa7float32"
    b"\x92\x08\t\x01\x93\xa5int32\x91\x08\xc4 \x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00"
    b"\x00\x04\x00\x00\x00\x05\x00\x00\x00\x06\x00\x00\x00\x07\x00\x00\x00\x08\x00\x00\x00"
    b"\xc0\x00\x00\xc0\xc0\xc0\xc0\x01\xcb\x00\x00\x00\x00\x00\x00\x00\x00"
)
BIG_AUX_FRAMES = [
    b"".join(i.to_bytes(4, "little") for i in range(72)),
    b"\x00\x00\x00\xbf" * 72,  # -0.5 as little-endian float32
]
CALL_BYTES = b"\x94\t\xb2reset_prefix_cache\x93\x01\xa1a\xc0\x03"
HELLO_BYTES = b"\x84\xa4type\xa5hello\xb0protocol_version\x01\xa3pid\xcd\x04\xd2\xa4name\xa5core0"
CONFIG_BYTES = (
    b"\x83\xa4type\xa6config\xa9addresses\x81\xa5input\xadipc:///tmp/in\xa7options\x81\xacm"
    b"ax_num_seqs\x08"
)
READY_BYTES = (
    b"\x85\xa4type\xa5ready\xadnum_kv_blocks\xcd\x02\x00\xaablock_size\x10\xadmax_model_len"
    b"\xcd\x08\x00\xa4info\x81\xa5dtype\xa4bf16"
)
SHUTDOWN_BYTES = b"\x82\xa4type\xa8shutdown\xa6reason\xa3bye"
ERROR_BYTES = (
    b"\x84\xa4type\xa5error\xa9type_name\xaaValueError\xa7message\xa3bad\xa9traceback\xa2tb"
)
ABORT_BYTES = b"\x92\xa5req-1\xa5req-2"
EMPTY_OUTPUTS_BYTES = b"\x97\x00\x90\xc0\xc0\xc0\x01\xcb\x00\x00\x00\x00\x00\x00\x00\x00"

MESSAGE_CASES = [
    pytest.param(SAMPLING, SamplingParams, SAMPLING_BYTES, id="SamplingParams"),
    pytest.param(REQUEST, EngineCoreRequest, REQUEST_BYTES, id="EngineCoreRequest"),
    pytest.param(DEFAULT_REQUEST, EngineCoreRequest, DEFAULT_REQUEST_BYTES, id="defaults"),
    pytest.param(EMBEDS_REQUEST, EngineCoreRequest, EMBEDS_REQUEST_BYTES, id="prompt-embeds"),
    pytest.param(OUTPUT, EngineCoreOutput, OUTPUT_BYTES, id="EngineCoreOutput"),
    pytest.param(OUTPUTS, EngineCoreOutputs, OUTPUTS_BYTES, id="EngineCoreOutputs"),
    pytest.param(CALL, UtilityCall, CALL_BYTES, id="UtilityCall"),
    pytest.param(["req-1", "req-2"], list[str], ABORT_BYTES, id="abort-ids"),
    pytest.param(HELLO, ControlMessage, HELLO_BYTES, id="Hello"),
    pytest.param(CONFIG, ControlMessage, CONFIG_BYTES, id="Config"),
    pytest.param(READY, ControlMessage, READY_BYTES, id="Ready"),
    pytest.param(SHUTDOWN, ControlMessage, SHUTDOWN_BYTES, id="Shutdown"),
    pytest.param(ERROR, ControlMessage, ERROR_BYTES, id="Error"),
]


@pytest.mark.parametrize(("msg", "type_", "golden"), MESSAGE_CASES)
def test_message_encodes_to_golden_bytes(msg: Any, type_: Any, golden: bytes) -> None:
    assert [bytes(f) for f in Encoder().encode(msg)] == [golden]


@pytest.mark.parametrize(("msg", "type_", "golden"), MESSAGE_CASES)
def test_golden_bytes_decode_to_the_message(msg: Any, type_: Any, golden: bytes) -> None:
    assert_wire_equal(Decoder(type_).decode([golden]), msg)


def test_logprobs_over_the_threshold_travel_as_golden_aux_frames() -> None:
    frames = encode_output(Encoder(), 3, BIG_OUTPUTS)

    assert [bytes(f) for f in frames] == [b"\x00\x03", BIG_OUTPUTS_BYTES, *BIG_AUX_FRAMES]
    client, decoded = OutputDecoder().decode([b"\x00\x03", BIG_OUTPUTS_BYTES, *BIG_AUX_FRAMES])
    assert client == 3
    assert_wire_equal(decoded, BIG_OUTPUTS)


INPUT_CASES = [
    pytest.param(EngineCoreRequestType.ADD_REQUEST, REQUEST, [b"\x00", REQUEST_BYTES], id="add"),
    pytest.param(
        EngineCoreRequestType.ABORT_REQUEST, ["req-1", "req-2"], [b"\x01", ABORT_BYTES], id="abort"
    ),
    pytest.param(EngineCoreRequestType.UTILITY, CALL, [b"\x02", CALL_BYTES], id="utility"),
]


@pytest.mark.parametrize(("kind", "payload", "golden"), INPUT_CASES)
def test_input_framing_is_golden(
    kind: EngineCoreRequestType, payload: Any, golden: list[bytes]
) -> None:
    assert [bytes(f) for f in encode_input(Encoder(), kind, payload)] == golden
    decoded_kind, decoded = InputDecoder().decode(golden)
    assert decoded_kind is kind
    assert_wire_equal(decoded, payload)


@pytest.mark.parametrize(
    ("client", "outputs", "golden"),
    [
        pytest.param(3, OUTPUTS, [b"\x00\x03", OUTPUTS_BYTES], id="client-3"),
        pytest.param(258, EngineCoreOutputs(seq=1), [b"\x01\x02", EMPTY_OUTPUTS_BYTES], id="258"),
    ],
)
def test_output_framing_is_golden(
    client: int, outputs: EngineCoreOutputs, golden: list[bytes]
) -> None:
    assert [bytes(f) for f in encode_output(Encoder(), client, outputs)] == golden
    decoded_client, decoded = OutputDecoder().decode(golden)
    assert decoded_client == client
    assert_wire_equal(decoded, outputs)


def test_enum_wire_values_are_pinned() -> None:
    assert {t.name: t.value for t in EngineCoreRequestType} == {
        "ADD_REQUEST": b"\x00",
        "ABORT_REQUEST": b"\x01",
        "UTILITY": b"\x02",
    }
    assert {r.name: int(r) for r in FinishReason} == {
        "STOP": 0,
        "LENGTH": 1,
        "ABORT": 2,
        "ERROR": 3,
        "REFUSED": 4,
    }
    assert [topic_for(i) for i in (0, 1, 255, 256, 65535)] == [
        b"\x00\x00",
        b"\x00\x01",
        b"\x00\xff",
        b"\x01\x00",
        b"\xff\xff",
    ]


def test_message_from_an_older_peer_without_trailing_fields_takes_the_defaults() -> None:
    body = msgspec.msgpack.encode(["req-1", [1, 2], []])

    decoded = Decoder(EngineCoreRequest).decode([body])

    assert_wire_equal(
        decoded,
        EngineCoreRequest(
            request_id="req-1", prompt_token_ids=[1, 2], sampling_params=SamplingParams()
        ),
    )


def test_message_from_a_newer_peer_with_appended_fields_decodes() -> None:
    body = msgspec.msgpack.encode([9, "sleep", [1], 3, "a field from the future", 42])

    decoded = Decoder(UtilityCall).decode([body])

    assert_wire_equal(decoded, UtilityCall(call_id=9, method="sleep", args=[1], client_index=3))


@pytest.mark.parametrize("salt", ["", "x" * 1025, 5, ["a"]])
def test_a_cache_salt_out_of_bounds_is_a_protocol_error(salt: object) -> None:
    from triode.wire import ProtocolError

    body = msgspec.msgpack.encode(["r", [1], [], None, 0.0, 0, 0, None, None, salt])

    with pytest.raises(ProtocolError, match=r"cache_salt|\$\[9\]"):
        InputDecoder().decode([EngineCoreRequestType.ADD_REQUEST.value, body])
