"""Which dtype a model runs in on this device (`resolve_dtype`)."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 where the hardware computes in it natively, else float32 (on CPUs
    without bf16 instructions bfloat16 matmuls run several times slower than float32)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on x86, the BF16 extension on Arm, as /proc/cpuinfo reports them."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
