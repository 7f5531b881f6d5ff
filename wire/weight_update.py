"""New weights from a trainer: what `/init_weight_transfer_engine` and `/update_weights` carry
(`init_info`, `update_info`), validated as they decode, since they come from an HTTP body.

Two backends. `shm` (a trainer on this host): each `/update_weights` names shared-memory
segments (`triode_tensor_<32 hex>`, as `tensor_ipc` draws them) and where each tensor lies in
its segment; every rank maps the segments and reads what it needs. `broadcast`: the trainer is
rank 0 of a torch.distributed group that every engine rank joins, and `/update_weights` lists
the tensors (vLLM's `names`, `dtype_names`, `shapes`) that rank 0 then broadcasts, in order.

Who removes a segment: the trainer made it and unlinks it once its `/update_weights` is
answered, however it went; the engine core also unlinks the update's segments once every rank
has read them (`unlink_buckets`), so a trainer that dies mid-call leaks nothing. Only names of
the shape `tensor_ipc` draws are ever opened or unlinked.

Bounds: an update lists at most `MAX_TENSORS` tensors in at most `MAX_BUCKETS` segments; a
segment, and a tensor, is at most `MAX_SEGMENT_BYTES`; names are at most `MAX_NAME` characters
of `[A-Za-z0-9_.-]`; tensors sit at `ALIGN`-byte offsets and do not overlap. Decoding costs time
linear in the body's size; nothing is allocated for what a body merely announces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from .codec import _ITEMSIZE, _MAX_DIMS
from .operations import OperationError
from .shm_segment import unlink_untracked
from .tensor_ipc import _NAME, MAX_TENSOR_BYTES

BACKENDS = ("shm", "broadcast")
TRANSPORTS = ("gloo", "nccl")
ALIGN = 64  # bytes: where a tensor may start in its segment
MAX_NAME = 512
MAX_TENSORS = 1 << 16  # in one update
MAX_BUCKETS = 1 << 12  # segments in one update
MAX_SEGMENT_BYTES = MAX_TENSOR_BYTES
MAX_WORLD = 1 << 16  # ranks of a broadcast group, the trainer's included
MAX_TIMEOUT = 3600.0  # seconds

Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.\-]+\Z")
]
Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEGMENT_BYTES)]
Shape = Annotated[tuple[Dim, ...], msgspec.Meta(max_length=_MAX_DIMS)]


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The size of a tensor of `dtype` (a codec dtype name) and `shape`. KeyError for a dtype
    the codec has no name for."""
    return math.prod(shape) * _ITEMSIZE[dtype]


def check_tensor(where: str, dtype: str, shape: tuple[int, ...]) -> int:
    """The size of a tensor of `dtype` and `shape`; ValueError, naming it as `where`, for a
    dtype the codec has no name for or a size over `MAX_SEGMENT_BYTES`."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"{where}: unknown dtype {dtype[:32]!r}")
    size = tensor_bytes(dtype, shape)
    if size > MAX_SEGMENT_BYTES:
        raise ValueError(f"{where}: {size} bytes, more than {MAX_SEGMENT_BYTES}")
    return size


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        seen.add(name)


# Initialisation


class ShmInit(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="backend", tag="shm"
):
    """The trainer shares this host's memory: nothing to set up."""


class BroadcastInit(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="backend", tag="broadcast"
):
    """The group to join: the trainer hosts its store at `master_address`:`master_port` and is
    rank 0 of `world_size`; an engine rank joins as `rank_offset + r`, the offset being the
    engine core's (the `rank_offset` here is vLLM's spelling of "engine ranks start after the
    trainer" and may only be 1). `transport` is gloo (CPU tensors) or nccl (CUDA); None takes the
    engine's device's. `timeout` bounds joining and each broadcast, in seconds."""

    master_address: Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^\S+\Z")]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    world_size: Annotated[int, msgspec.Meta(ge=2, le=MAX_WORLD)]
    transport: Literal["gloo", "nccl"] | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT)] = 120.0
    rank_offset: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


InitInfo = ShmInit | BroadcastInit


# Updates


class ShmTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of a segment: `nbytes(dtype, shape)` bytes from `offset`, in C order,
    little-endian (bfloat16 as its bits)."""

    name: Name
    dtype: str
    shape: Shape
    offset: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEGMENT_BYTES)]

    def __post_init__(self) -> None:
        check_tensor(f"tensor {self.name!r}", self.dtype, self.shape)
        if self.offset % ALIGN:
            raise ValueError(f"tensor {self.name!r}: offset {self.offset} is not {ALIGN}-aligned")

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


class ShmBucket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A segment of `nbytes` bytes and the tensors in it, none overlapping another."""

    shm_name: str
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEGMENT_BYTES)]
    tensors: Annotated[list[ShmTensor], msgspec.Meta(max_length=MAX_TENSORS)]

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.shm_name):
            raise ValueError(f"shm_name: {self.shm_name[:64]!r} is not a shared tensor's name")
        end = 0
        for t in sorted((t for t in self.tensors if t.nbytes), key=lambda t: t.offset):
            if t.offset < end:
                raise ValueError(f"tensor {t.name!r} overlaps the one before it")
            end = t.offset + t.nbytes
            if end > self.nbytes:
                raise ValueError(
                    f"tensor {t.name!r} ends at byte {end}, past its {self.nbytes}-byte segment"
                )


class ShmUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`update_info` of the shm backend."""

    buckets: Annotated[list[ShmBucket], msgspec.Meta(max_length=MAX_BUCKETS)]

    def __post_init__(self) -> None:
        names = [t.name for b in self.buckets for t in b.tensors]
        if len(names) > MAX_TENSORS:
            raise ValueError(f"{len(names)} tensors in one update, more than {MAX_TENSORS}")
        _check_unique(names)
        if len({b.shm_name for b in self.buckets}) != len(self.buckets):
            raise ValueError("a segment is listed twice")


class BroadcastUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`update_info` of the broadcast backend: the tensors rank 0 broadcasts next, in order.
    `packed` is vLLM's packed broadcast, which triode does not speak (False only)."""

    names: Annotated[list[Name], msgspec.Meta(max_length=MAX_TENSORS)]
    dtype_names: Annotated[list[str], msgspec.Meta(max_length=MAX_TENSORS)]
    shapes: Annotated[list[Shape], msgspec.Meta(max_length=MAX_TENSORS)]
    packed: bool = False

    def __post_init__(self) -> None:
        if self.packed:
            raise ValueError("packed: packed broadcasts are not supported")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            check_tensor(f"tensor {name!r}", dtype, shape)
        _check_unique(self.names)


UpdateInfo = ShmUpdate | BroadcastUpdate


def decode_init_info(obj: Any) -> InitInfo:
    """`init_info` (parsed JSON) as its struct. A body without `backend` is vLLM's, which knows
    only the broadcast. Raises OperationError("invalid") saying what is wrong and where."""
    if isinstance(obj, dict) and "backend" not in obj:
        obj = {**obj, "backend": "broadcast"}
    return _convert(obj, InitInfo, "init_info")  # type: ignore[arg-type]


def decode_update_info(obj: Any, backend: Literal["shm", "broadcast"]) -> UpdateInfo:
    """`update_info` (parsed JSON) of `backend` as its struct. Raises OperationError("invalid")
    saying what is wrong and where."""
    return _convert(obj, ShmUpdate if backend == "shm" else BroadcastUpdate, "update_info")


def _convert(obj: Any, kind: Any, what: str) -> Any:
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as e:
        message = str(e)
        message = message.replace("`$", f"`{what}", 1) if "`$" in message else f"{what}: {message}"
        raise OperationError("invalid", message[:1000]) from None


def unlink_buckets(update_info: ShmUpdate | Mapping[str, Any]) -> int:
    """Unlink every segment `update_info` names: an `ShmUpdate`, or the raw `update_info` that
    may not have decoded (then only its `buckets[i].shm_name` strings of a shared tensor's shape
    are taken, at most `MAX_BUCKETS`). Idempotent, never raises for what the body holds; the
    number of segments it removed."""
    if isinstance(update_info, ShmUpdate):
        names = [b.shm_name for b in update_info.buckets]
    else:
        buckets = update_info.get("buckets") if isinstance(update_info, Mapping) else None
        names = [
            b["shm_name"]
            for b in (buckets[:MAX_BUCKETS] if isinstance(buckets, list) else [])
            if isinstance(b, Mapping)
            and isinstance(b.get("shm_name"), str)
            and _NAME.fullmatch(b["shm_name"])
        ]
    return sum(unlink_untracked(name) for name in names)
