"""The shm backend's two sides: the trainer packs a bucket of tensors into one new segment
(`write_bucket`), and each engine rank maps the update's segments and views its tensors in
place (`mapped_weights`).

A rank opens a segment read-only and maps it copy-on-write: the tensors it hands on are views
of the trainer's pages, so only what the rank's loader copies out of them is read (a rank of a
tensor-parallel world reads its own shard), and a loader that wrote into one would change its
private copy, never the segment.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import mmap
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from triode.wire.operations import OperationError
from triode.wire.shm_segment import open_untracked, unlink_untracked
from triode.wire.tensor_ipc import NAME_PREFIX
from triode.wire.weight_update import (
    ALIGN,
    MAX_SEGMENT_BYTES,
    ShmBucket,
    ShmTensor,
    ShmUpdate,
    check_tensor,
)


def dtype_name(tensor: torch.Tensor) -> str:
    """The wire's name of `tensor`'s dtype. ValueError for one the wire has no name for."""
    name = str(tensor.dtype).removeprefix("torch.")
    check_tensor(f"a tensor of {tensor.dtype}", name, ())
    return name


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each of `tensors` starts in a bucket that packs them in order, `ALIGN`-aligned
    (an empty one at 0), and the bucket's size (at least one byte: a segment cannot be empty).
    """
    offsets, end = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        start = -(-end // ALIGN) * ALIGN if size else 0
        offsets.append(start)
        end = max(end, start + size)
    return offsets, max(end, 1)


def write_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> ShmBucket:
    """A new segment holding `named`'s tensors (of any device and layout), and its description
    for `update_info`. The caller unlinks it (`unlink_untracked(bucket.shm_name)`) once the
    update that names it is answered. ValueError for a dtype the wire cannot name or a bucket
    over `MAX_SEGMENT_BYTES`, OSError when shared memory has no room; either way no segment is
    left behind."""
    tensors = [t.detach() for _, t in named]
    dtypes = [dtype_name(t) for t in tensors]
    offsets, nbytes = layout(tensors)
    if nbytes > MAX_SEGMENT_BYTES:
        raise ValueError(f"a bucket of {nbytes} bytes is over {MAX_SEGMENT_BYTES}")
    name = NAME_PREFIX + secrets.token_hex(16)
    shm = open_untracked(name, create=True, size=nbytes)
    try:
        # the pages now: a full /dev/shm is an OSError here rather than a SIGBUS mid-copy
        os.posix_fallocate(shm._fd, 0, nbytes)  # type: ignore[attr-defined]
        for t, offset in zip(tensors, offsets, strict=True):
            if t.numel():
                into = torch.frombuffer(shm.buf, dtype=t.dtype, count=t.numel(), offset=offset)
                into.view(t.shape).copy_(t)
                del into  # the view holds the mapping open
    except BaseException:
        shm.close()
        unlink_untracked(name)
        raise
    shm.close()
    return ShmBucket(
        shm_name=name,
        nbytes=nbytes,
        tensors=[
            ShmTensor(name=n, dtype=d, shape=tuple(t.shape), offset=o)
            for (n, _), t, d, o in zip(named, tensors, dtypes, offsets, strict=True)
        ],
    )


@contextmanager
def mapped_weights(update: ShmUpdate) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every tensor of `update`, as (name, CPU tensor) in its order: views of the segments'
    copy-on-write mappings, valid inside the block (a loader copies out of them). The mappings
    close on the way out, or, where a tensor is still referenced, when the last one is gone.

    Raises OperationError("invalid") when a segment is missing or not its stated size."""
    with ExitStack() as stack:
        weights: list[tuple[str, torch.Tensor]] = []
        for bucket in update.buckets:
            mapping = _map(bucket)
            stack.callback(_close, mapping)
            weights += [(t.name, _view(mapping, t)) for t in bucket.tensors]
        try:
            yield weights
        finally:
            weights.clear()


def _map(bucket: ShmBucket) -> mmap.mmap:
    try:
        fd = _posixshmem.shm_open("/" + bucket.shm_name, os.O_RDONLY, 0)
    except FileNotFoundError:
        raise OperationError("invalid", f"segment {bucket.shm_name} does not exist") from None
    except OSError as e:
        raise OperationError("invalid", f"segment {bucket.shm_name}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != bucket.nbytes:
            raise OperationError(
                "invalid",
                f"segment {bucket.shm_name} holds {size} bytes, not the {bucket.nbytes} stated",
            )
        return mmap.mmap(fd, bucket.nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def _view(mapping: mmap.mmap, t: ShmTensor) -> torch.Tensor:
    dtype = getattr(torch, t.dtype)
    if not t.nbytes:
        return torch.empty(t.shape, dtype=dtype)
    count = t.nbytes // dtype.itemsize
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=t.offset).view(t.shape)


def _close(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a tensor still views it; the mapping goes with the last one
