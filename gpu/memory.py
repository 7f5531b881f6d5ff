"""Giving a model's memory back to the operating system, and measuring what this process holds.

Dropping the last reference to a tensor returns its block to torch's allocator, which is not the
same as returning it to the system: on the CPU the allocator is glibc's malloc, which keeps freed
heap blocks for reuse (only blocks past its mmap threshold go back at once, and that threshold
rises to the largest block freed so far, up to 32 MiB), so a model's many medium weights stay
resident after they are freed until `malloc_trim` hands the free pages back; on CUDA the caching
allocator keeps them until `torch.cuda.empty_cache`.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
from collections.abc import Callable, Iterable
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from .gguf_file import release_mapped_files


def rss_bytes() -> int:
    """This process's resident set (VmRSS of /proc/self/status), in bytes; 0 where there is no
    /proc."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_report(device: torch.device) -> dict[str, int]:
    """What every operation returns about this process: its pid and resident set, and on CUDA
    the bytes torch holds on the device (allocated to tensors, and reserved by its cache)."""
    report = {"pid": os.getpid(), "rss_bytes": rss_bytes()}
    if device.type == "cuda":
        report["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        report["cuda_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return report


def release_memory(device: torch.device) -> None:
    """Return the memory of tensors no longer referenced to the system: collect reference
    cycles first, then trim glibc's heap (CPU) or empty torch's cache (CUDA)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None under another C library (musl has none to call)."""
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of the distinct storages behind `tensors` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.is_meta:
            continue
        if tensor.is_mkldnn:  # an opaque oneDNN layout: no storage to look at
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor `model` keeps for its weights: parameters, buffers, oneDNN-packed copies
    (`LinearBase.packed`) and weights as GGUF stores them (`LinearBase.int4`, `.quant`)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        experts = getattr(module, "expert_kernels", None) or []
        for kernel in (
            getattr(module, "int4", None),
            getattr(module, "quant", None),
            *chain(*experts),
        ):
            if kernel is not None:
                tensors += [t for t in vars(kernel).values() if isinstance(t, torch.Tensor)]
    return tensors


def free_model(model: nn.Module) -> None:
    """Drop the memory of every tensor in `model_tensors`, leaving an empty shell of modules
    (parameters of no elements) that nothing can run."""
    with torch.no_grad():
        for param in model.parameters():  # a tied weight is one parameter: freed once
            param.data = param.data.new_empty(0)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.new_empty(0))
            if getattr(module, "packed", None) is not None:
                module.packed = None
            if getattr(module, "stored", None) is not None:
                module.stored = None  # the file's blocks go as they are: nothing to dequantize
            detach = getattr(module, "detach_quantized", None)
            if detach is not None:
                detach()
    release_mapped_files()  # and the pages of the GGUF files they were read from
