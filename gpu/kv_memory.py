"""Where a KV cache's memory comes from. A cache that "auto" sized from the machine
(`kv_sizing`) is, on a CPU, pages the kernel zeroes as they are first written: it takes memory
as its blocks fill, so a start costs nothing for it (zeroing the 5.5 GiB "auto" gives the
default model on a 24 GiB machine takes 2 s, and the whole of it stays resident however little
is used). A size given is taken whole at start, as asked: a machine without it fails then, not
while serving, and a sleep (`operations.Operations`) gives all of it back."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, lazy: bool
) -> torch.Tensor:
    """A tensor of zeros of `shape`; where `lazy` and on a CPU, over an anonymous private
    mapping: a page never written reads as the kernel's zero page, is taken on its first write,
    and is given back once the tensor and its views are gone."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not lazy or device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)
