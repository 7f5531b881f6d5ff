"""Large tensors between processes on one host: the data in a POSIX shared-memory segment, only a
small `TensorHandle` in the message.

Who removes a segment: the sender makes it (`share`) and unlinks it through its
`SharedTensor` when the message's work ends, however it ends (finished, failed, aborted); the
receiver copies the data out (`open_shared`) and, with `unlink=True`, unlinks it at once.
Unlinking is idempotent, whichever side comes first, so a segment outlives neither a dead
receiver (the sender unlinks it) nor a sender that dies once its message is out (the receiver
does). Neither side registers segments with multiprocessing's resource tracker
(`shm_segment.open_untracked`).

A receiver opens, and unlinks, only names of the form `triode_tensor_<32 hex digits>`, which
`share` draws at random, so a hostile handle cannot make it read or remove any other segment.
Handles validate at decode (`ProtocolError` through the codec, `ValueError` when built), and
`open_shared` raises `ProtocolError` for a segment that is missing or not the handle's size.

numpy only: a torch tensor is shared when torch is already imported by the caller; bfloat16,
which numpy lacks, travels as its uint16 bits and comes back as a uint16 array.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import sys
from typing import Annotated, Any

import msgspec
import numpy as np

from .codec import _DTYPES, _ITEMSIZE, _MAX_DIMS
from .errors import ProtocolError
from .shm_segment import open_untracked, unlink_untracked

NAME_PREFIX = "triode_tensor_"
_NAME = re.compile(NAME_PREFIX + "[0-9a-f]{32}")
# the largest tensor a handle may describe
MAX_TENSOR_BYTES = 1 << 34
_BFLOAT16 = np.dtype("<u2")


class TensorHandle(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Where a shared tensor is: its segment's name, its dtype (a codec dtype name: `float32`,
    `bfloat16`, ...), its shape and its size in bytes, which must agree."""

    shm_name: str
    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_TENSOR_BYTES)]

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.shm_name):
            raise ValueError(f"shm_name: {self.shm_name[:64]!r} is not a shared tensor's name")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype: unknown dtype {self.dtype[:32]!r}")
        if len(self.shape) > _MAX_DIMS:
            raise ValueError(f"shape: more than {_MAX_DIMS} dimensions")
        expected = math.prod(self.shape) * _ITEMSIZE[self.dtype]
        if expected != self.nbytes:
            raise ValueError(
                f"nbytes: {self.nbytes} disagrees with {list(self.shape)} {self.dtype} "
                f"({expected} bytes)"
            )


class SharedTensor:
    """The sender's hold on a shared tensor's segment; `unlink` removes it (idempotent)."""

    __slots__ = ("handle",)

    def __init__(self, handle: TensorHandle) -> None:
        self.handle = handle

    def unlink(self) -> None:
        unlink_untracked(self.handle.shm_name)


def share(tensor: Any, *, dtype: str | None = None) -> tuple[TensorHandle, SharedTensor]:
    """Copy `tensor` into a new segment: its handle, for the message, and the sender's hold on
    it, to unlink when the message's work is over.

    `tensor` is a numpy array or a torch tensor (moved to the CPU); a uint16 or int16 array
    with `dtype="bfloat16"` holds bfloat16 bits. Raises ValueError for an empty tensor or a
    dtype the codec has no name for, and OSError when shared memory has no room for it."""
    name, shape, raw = _raw_bytes(tensor, dtype)
    if raw.nbytes == 0:
        raise ValueError("cannot share an empty tensor")
    handle = TensorHandle(NAME_PREFIX + secrets.token_hex(16), name, shape, raw.nbytes)
    shm = open_untracked(handle.shm_name, create=True, size=raw.nbytes)
    try:
        # Take the pages now: a full /dev/shm is then an OSError here rather than a SIGBUS
        # in the middle of the copy.
        os.posix_fallocate(shm._fd, 0, raw.nbytes)  # type: ignore[attr-defined]
        with shm.buf[: raw.nbytes] as view:
            view[:] = raw
    except BaseException:
        shm.close()
        unlink_untracked(handle.shm_name)
        raise
    shm.close()  # the name keeps the segment; the sender needs no mapping
    return handle, SharedTensor(handle)


def open_shared(handle: TensorHandle, *, unlink: bool = False) -> np.ndarray:
    """A copy of the tensor `handle` names, as a writable numpy array (bfloat16 as uint16 bits);
    with `unlink`, the segment is unlinked afterwards whatever happened (the receiver's part).

    Raises ProtocolError when no such segment exists or it is not the handle's size."""
    try:
        try:
            shm = open_untracked(handle.shm_name)
        except FileNotFoundError:
            raise ProtocolError(f"shared tensor {handle.shm_name} does not exist") from None
        except (OSError, ValueError) as e:  # ValueError: an empty segment cannot be mapped
            raise ProtocolError(f"shared tensor {handle.shm_name} cannot be mapped: {e}") from None
        try:
            if shm.size != handle.nbytes:
                raise ProtocolError(
                    f"shared tensor {handle.shm_name} holds {shm.size} bytes, but its handle "
                    f"says {handle.nbytes}"
                )
            dtype = _DTYPES[handle.dtype] or _BFLOAT16
            out = np.empty(handle.shape, dtype=dtype)
            with shm.buf[: handle.nbytes] as view:
                memoryview(out.reshape(-1).view(np.uint8))[:] = view
        finally:
            shm.close()
    finally:
        if unlink:
            unlink_untracked(handle.shm_name)
    return out


def _raw_bytes(tensor: Any, dtype: str | None) -> tuple[str, tuple[int, ...], memoryview]:
    """(codec dtype name, shape, the bytes in C order, little-endian) of `tensor`."""
    if isinstance(tensor, np.ndarray):
        name = tensor.dtype.name
        if dtype == "bfloat16" and tensor.dtype.kind in "ui" and tensor.dtype.itemsize == 2:
            name = dtype
        elif _DTYPES.get(name) is None or tensor.dtype.hasobject:
            raise ValueError(f"cannot share arrays of dtype {tensor.dtype}")
        elif dtype is not None and dtype != name:
            raise ValueError(f"an array of {name} cannot be shared as {dtype}")
        arr = np.ascontiguousarray(tensor, dtype=tensor.dtype.newbyteorder("<"))
        return name, tuple(arr.shape), memoryview(arr.reshape(-1).view(np.uint8))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES or (dtype is not None and dtype != name):
            raise ValueError(f"cannot share a tensor of {tensor.dtype} as {dtype or name}")
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return name, tuple(t.shape), memoryview(raw)
    raise ValueError(f"cannot share objects of type {type(tensor).__name__}")
