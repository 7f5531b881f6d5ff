"""Multipart framing for the engine's two sockets.

Input (edge -> engine core, PUSH -> PULL): `[type, msgpack, *aux]`, `type` one byte.
Output (engine core -> edges, PUB -> SUB): `[topic, msgpack, *aux]`, `topic` the client index as
two big-endian bytes, so SUB prefix matching is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .codec import Buffer, Decoder, Encoder
from .errors import ProtocolError
from .messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityCall

InputPayload = EngineCoreRequest | list[str] | UtilityCall

_TYPES = {t.value: t for t in EngineCoreRequestType}


def topic_for(client_index: int) -> bytes:
    return client_index.to_bytes(2, "big")


def client_of_topic(topic: bytes) -> int | None:
    """The client index `topic` names (`topic_for`'s inverse), or None if it names none."""
    return int.from_bytes(topic, "big") if len(topic) == 2 else None


def encode_input(
    encoder: Encoder, kind: EngineCoreRequestType, payload: InputPayload
) -> list[Buffer]:
    return [kind.value, *encoder.encode(payload)]


def encode_output(encoder: Encoder, client_index: int, outputs: EngineCoreOutputs) -> list[Buffer]:
    return [topic_for(client_index), *encoder.encode(outputs)]


class InputDecoder:
    """Decodes input frames into `(type, payload)`; ABORT's payload is a list of request ids."""

    def __init__(self) -> None:
        self._decoders: dict[EngineCoreRequestType, Decoder[Any]] = {
            EngineCoreRequestType.ADD_REQUEST: Decoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT_REQUEST: Decoder(list[str]),
            EngineCoreRequestType.UTILITY: Decoder(UtilityCall),
        }

    def decode(self, frames: Sequence[Any]) -> tuple[EngineCoreRequestType, InputPayload]:
        if len(frames) < 2:
            raise ProtocolError(f"input message needs at least 2 frames, got {len(frames)}")
        head = _small_bytes(frames[0], 1)
        kind = _TYPES.get(head) if head is not None else None
        if kind is None:
            raise ProtocolError("first frame is not a known one-byte request type")
        return kind, self._decoders[kind].decode(frames[1:])


class OutputDecoder:
    """Decodes output frames into `(client_index, EngineCoreOutputs)`."""

    def __init__(self) -> None:
        self._decoder = Decoder(EngineCoreOutputs)

    def decode(self, frames: Sequence[Any]) -> tuple[int, EngineCoreOutputs]:
        if len(frames) < 2:
            raise ProtocolError(f"output message needs at least 2 frames, got {len(frames)}")
        client = client_of_topic(_small_bytes(frames[0], 2) or b"")
        if client is None:
            raise ProtocolError("topic frame must be 2 bytes")
        return client, self._decoder.decode(frames[1:])


def _small_bytes(frame: Any, size: int) -> bytes | None:
    """The frame's bytes if it is exactly `size` long, without copying a large frame."""
    try:
        view = memoryview(frame)
    except TypeError:
        return None
    return view.tobytes() if view.nbytes == size else None
