"""The wire decoders: input and output framing, control messages, and the generic `Decoder`.

Every decoder is total: any frames decode to a valid message or raise `ProtocolError`. What
decodes must survive a round trip: encoded again (inline or with aux frames) and decoded, it is
the same message, bit for bit. Decoders are module-level and reused across inputs, as receivers
reuse theirs, so state left behind by a failed decode shows up too.

Input layout (first byte): even, `frames`: a target byte, then frames as `[kind][length][bytes]`
records (see `frames_input`), the kind choosing literal, repeated (oversized) or duplicated
frames; odd, `mutate`: a valid message drawn from the bytes is encoded, checked to round-trip,
then mutated frame-wise (bit flips, truncation, splicing, dropped, extra or oversized aux frames)
by further draws and decoded.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq

from triode.wire import (
    ControlMessage,
    Decoder,
    Encoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    InputDecoder,
    Logprobs,
    ModelRunnerOutput,
    OutputDecoder,
    ProtocolError,
    SamplingParams,
    SchedulerOutput,
    UtilityCall,
    UtilityOutput,
    encode_input,
    encode_output,
)

from .messages import VALID
from .source import ByteSource

MAX_FRAMES = 8
MAX_BIG_FRAME = 1 << 20  # an oversized frame: a byte repeated up to this many times
ENCODERS = {threshold: Encoder(aux_threshold=threshold) for threshold in (0, 64, 256, 1 << 30)}

_INPUT = InputDecoder()
_OUTPUT = OutputDecoder()

# msgpack headers at their widths' edges, and the strings arrays and tags are made of.
DICTIONARY = [b"\xc0", b"\xc2", b"\xc3", b"\xcc\xff", b"\xcd\xff\xff", b"\xce\xff\xff\xff\xff",
              b"\xcf" + b"\xff" * 8, b"\xd3\x80" + bytes(7), b"\xdc\xff\xff",
              b"\xdd\xff\xff\xff\xff", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc4\xff",
              b"\xc6\xff\xff\xff\xff", b"\xd9\xff", b"\xcb\x7f\xf8" + bytes(6), b"\x91" * 32,
              b"\x93\xa5int32\x92", b"\xa7float32", b"\xa8bfloat16", b"\xa5hello", b"\xa6config",
              b"\xa5ready", b"\xa4type", b"\x00\x00", b"\x00", b"\x01", b"\x02"]  # fmt: skip


def _typed(kind: Any) -> tuple[Callable[[Sequence[Any]], Any], Callable[[Encoder, Any], list]]:
    return Decoder(kind).decode, lambda encoder, msg: encoder.encode(msg)


# name -> (decode frames, encode what was decoded)
TARGETS: dict[str, tuple[Callable[[Sequence[Any]], Any], Callable[[Encoder, Any], list]]] = {
    "input": (_INPUT.decode, lambda encoder, msg: encode_input(encoder, *msg)),
    "output": (_OUTPUT.decode, lambda encoder, msg: encode_output(encoder, *msg)),
    "control": _typed(ControlMessage),
    "EngineCoreRequest": _typed(EngineCoreRequest),
    "EngineCoreOutputs": _typed(EngineCoreOutputs),
    "SamplingParams": _typed(SamplingParams),
    "Logprobs": _typed(Logprobs),
    "UtilityCall": _typed(UtilityCall),
    "UtilityOutput": _typed(UtilityOutput),
    "abort-ids": _typed(list[str]),
    "SchedulerOutput": _typed(SchedulerOutput),
    "ModelRunnerOutput": _typed(ModelRunnerOutput),
    "ndarray": _typed(np.ndarray),
}
TARGET_NAMES = list(TARGETS)


def test_one_input(data: bytes) -> None:
    src = ByteSource(data)
    if src.byte() % 2 == 0:
        target = src.choice(TARGET_NAMES)
        check(target, _frames(src))
    else:
        _mutated(src)


def check(target: str, frames: list[Any], *, valid: bool = False) -> None:
    """Decode `frames` with `target`'s decoder: a ProtocolError (unless they are `valid`), or a
    message that round-trips."""
    decode, encode = TARGETS[target]
    try:
        msg = decode(frames)
    except ProtocolError as e:
        assert not valid, f"{target} refused a valid message: {e}"
        assert isinstance(e.args[0], str)
        return
    _check_arrays_read_only(msg)
    for encoder in (ENCODERS[0], ENCODERS[1 << 30]):
        again = [bytes(f) for f in encode(encoder, msg)]
        try:
            twice = decode(again)
        except ProtocolError as e:
            raise AssertionError(f"{target} decoded {msg!r}, which does not round-trip") from e
        assert_wire_equal(twice, msg)


# Input formats


def frames_input(target: str, frames: Sequence[bytes]) -> bytes:
    """The `frames`-mode input that decodes `frames` with `target` (for seed corpora)."""
    out = bytearray([0, TARGET_NAMES.index(target)])
    for frame in frames:
        out += b"\0" + _varint(len(frame)) + bytes(frame)
    return bytes(out)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _read_varint(src: ByteSource) -> int:
    n = shift = 0
    for _ in range(4):
        b = src.byte()
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    return n


def _frames(src: ByteSource) -> list[Any]:
    frames: list[bytes] = []
    while src.remaining and len(frames) < MAX_FRAMES:
        kind = src.byte()
        if kind == 1:  # oversized: one byte repeated
            size = min(_read_varint(src) * 64, MAX_BIG_FRAME)
            frames.append(src.take(1) * size)
        elif kind == 2 and frames:  # a copy of an earlier frame
            frames.append(frames[src.int(0, len(frames) - 1)])
        else:
            frames.append(src.take(_read_varint(src)))
    return _as_received(src, frames)


def _as_received(src: ByteSource, frames: list[bytes]) -> list[Any]:
    """Frames as a receiver may hold them: bytes, zmq.Frame (zero-copy receive) or views."""
    how = src.byte() % 4
    if how == 1:
        return [zmq.Frame(f) for f in frames]
    if how == 2:
        return [memoryview(f) for f in frames]
    if how == 3:
        return [bytearray(f) for f in frames]
    return frames


_MUTATIONS = ("flip", "set", "insert", "delete", "truncate", "drop", "duplicate", "swap",
              "splice", "extra", "oversize", "empty")  # fmt: skip


def _mutated(src: ByteSource) -> None:
    target = src.choice(TARGET_NAMES)
    encoder = src.choice(list(ENCODERS.values()))
    frames = [bytes(f) for f in VALID[target](src, encoder)]
    check(target, frames, valid=True)
    out = [bytearray(f) for f in frames]
    for _ in range(src.int(1, 4)):
        op = src.choice(_MUTATIONS)
        i = src.int(0, len(out) - 1)
        frame = out[i]
        pos = src.int(0, len(frame))
        if op == "flip" and pos < len(frame):
            frame[pos] ^= 1 << src.int(0, 7)
        elif op == "set" and pos < len(frame):
            frame[pos] = src.byte()
        elif op == "insert":
            frame[pos:pos] = src.blob(8)
        elif op == "delete":
            del frame[pos : pos + src.int(1, 8)]
        elif op == "truncate":
            del frame[pos:]
        elif op == "drop" and len(out) > 1:
            del out[i]
        elif op == "duplicate":
            out.insert(i, bytearray(frame))
        elif op == "swap":
            j = src.int(0, len(out) - 1)
            out[i], out[j] = out[j], out[i]
        elif op == "splice":
            other = out[src.int(0, len(out) - 1)]
            at = src.int(0, len(other))
            frame[pos:] = other[at:]
        elif op == "extra":
            out.insert(src.int(0, len(out)), bytearray(src.blob(600)))
        elif op == "oversize":
            out[i] = frame + bytes(src.int(1, MAX_BIG_FRAME))
        elif op == "empty":
            out[i] = bytearray()
    check(target, _as_received(src, [bytes(f) for f in out]))


# Invariants


def _check_arrays_read_only(msg: Any) -> None:
    """Arrays alias the received frames, which must not be written through them."""
    for array in arrays_in(msg):
        assert not array.flags.writeable, "a decoded array is writeable"


def arrays_in(msg: Any) -> list[np.ndarray]:
    """Every numpy array inside a message, in encoding order."""
    if isinstance(msg, np.ndarray):
        return [msg]
    if isinstance(msg, msgspec.Struct):
        return [a for f in msg.__struct_fields__ for a in arrays_in(getattr(msg, f))]
    if isinstance(msg, list | tuple):
        return [a for item in msg for a in arrays_in(item)]
    if isinstance(msg, dict):
        return [a for item in msg.values() for a in arrays_in(item)]
    return []


def assert_wire_equal(a: Any, b: Any, path: str = "$") -> None:
    """Structural equality, exact types included; arrays and tensors compare dtype, shape and
    bits. The wire's property tests use it too.

    Struct `==` cannot be used: it asks an array comparison for a single truth value.
    """
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, msgspec.Struct):
        for name in a.__struct_fields__:
            assert_wire_equal(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: values differ"
        assert a.tobytes() == b.tobytes(), f"{path}: bits differ"
    elif _is_tensor(a):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        assert _tensor_bits(a) == _tensor_bits(b), f"{path}: bits differ"
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_wire_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert_wire_equal(list(a), list(b), f"{path}.keys()")  # NaN keys compare as equal
        for (key, x), y in zip(a.items(), b.values(), strict=True):
            assert_wire_equal(x, y, f"{path}[{key!r}]")
    elif isinstance(a, float):
        same = (
            math.isnan(b) if math.isnan(a) else (a, math.copysign(1, a)) == (b, math.copysign(1, b))
        )
        assert same, f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: triode.wire must work without it
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_bits(t: Any) -> bytes:
    # only ever given a tensor, so torch is loaded already: this module never loads it itself
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
