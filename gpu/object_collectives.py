"""Typed values through torch.distributed collectives, as msgpack bytes in a uint8 tensor.

torch's own `all_gather_object` and `broadcast_object_list` pickle: a peer that can reach a
rank's collectives could make it run code. Here a value goes out as msgspec's msgpack, its
length first (one int64 collective) and then the bytes (one uint8 collective), and comes back
through a decoder of the type the caller names, so a rank only ever builds the values it
expects. Lengths are capped before anything is allocated for them.

Each function is a collective: every rank of `group` calls it in the same order with the same
`type` (and `src`). On the CPU the tensors stay there (gloo); with nccl they go to the current
CUDA device.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from triode.wire.errors import ProtocolError

T = TypeVar("T")

# far above any report, endpoint list or segment name the engine gathers; a peer's claimed
# length past it is refused before a buffer of that size exists
MAX_OBJECT_BYTES = 16 << 20

_encoder = msgspec.msgpack.Encoder()


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: object) -> bytes:
    payload = _encoder.encode(value)
    if len(payload) > MAX_OBJECT_BYTES:
        raise ValueError(f"{len(payload)} bytes to share; the limit is {MAX_OBJECT_BYTES}")
    return payload


def _decode(payload: bytes, type: Any, rank: int) -> Any:
    try:
        return msgspec.msgpack.decode(payload, type=type)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError(f"rank {rank} shared an undecodable value: {e}") from e


def _checked_length(length: int, rank: int) -> int:
    if not 0 <= length <= MAX_OBJECT_BYTES:
        raise ProtocolError(f"rank {rank} claims {length} bytes; the limit is {MAX_OBJECT_BYTES}")
    return length


def all_gather(value: T, type: type[T] | Any, *, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's `value`, in the group's rank order, each decoded as `type`. Raises
    ProtocolError when a rank's bytes are not a `type` (or claim more than MAX_OBJECT_BYTES)."""
    device = _device(group)
    payload = _encode(value)
    world = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [_checked_length(int(n.item()), r) for r, n in enumerate(lengths)]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [
        _decode(t[:n].cpu().numpy().tobytes(), type, r)
        for r, (t, n) in enumerate(zip(gathered, sizes, strict=True))
    ]


def broadcast(
    value: T | None, type: type[T] | Any, *, src: int, group: dist.ProcessGroup | None = None
) -> T:
    """Group rank `src`'s `value` on every rank of `group`, decoded as `type` (the other ranks'
    `value` is ignored). Raises ProtocolError as `all_gather` does."""
    device = _device(group)
    sender = dist.get_rank(group) == src
    payload = _encode(value) if sender else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=src)
    size = _checked_length(int(length.item()), src)
    if sender:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        dist.broadcast(data, group=group, group_src=src)
    return _decode(data.cpu().numpy().tobytes(), type, src)
