"""CPU kernels written in C, built at first use with the machine's compiler, called by ctypes.

`paged_attention.c` holds decode attention that reads the paged KV cache in place. It is built
once per source, compiler and CPU into `$TRIODE_CACHE/kernels/` with -O3 -march=native -fopenmp;
its OpenMP runtime is the one torch already loaded (the same soname), so its threads are
torch's. Without a C compiler, or with TRIODE_CPU_KERNELS=0, `paged_decode_attention` is None
and attention takes the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .loader import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

Kernel = Callable[..., torch.Tensor]


def paged_decode_attention_for(num_heads: int, num_kv_heads: int, head_dim: int) -> Kernel | None:
    """The kernel for a model of this attention shape, or None (none built, or a shape past
    what it was built for)."""
    kernel = paged_decode_attention()
    if kernel is None or num_heads % num_kv_heads:
        return None
    if num_heads > kernel.max_heads or head_dim > kernel.max_head_dim:  # type: ignore[attr-defined]
        return None
    return kernel


@functools.cache
def paged_decode_attention() -> Kernel | None:
    """The built kernel as `f(q, k_cache, v_cache, block_tables, context_lens, scale)`, or None."""
    if os.environ.get("TRIODE_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        return None
    function = library.triode_paged_decode_attention_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    max_head_dim, max_heads = library.triode_max_head_dim(), library.triode_max_heads()

    def run(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [seqs, heads, head_dim] bfloat16; caches [blocks, block_size, kv_heads, head_dim];
        block_tables [seqs, max_blocks] and context_lens [seqs] int64. Returns like q."""
        seqs, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if head_dim > max_head_dim or heads > max_heads or heads % kv_heads:
            raise ValueError(f"{heads} heads over {kv_heads} KV heads of {head_dim} not built for")
        for t in (k_cache, v_cache):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("the KV cache must be contiguous bfloat16")
        q = q.contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, head_dim, block_size,
            tables.shape[1], scale,
        )  # fmt: skip
        return out

    run.max_heads, run.max_head_dim = max_heads, max_head_dim  # type: ignore[attr-defined]
    return run


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_flags()):
        key.update(part)
        key.update(b"\0")
    out = cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: a concurrent build of the same key loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", out)
    return out


def _cpu_flags() -> bytes:
    """-march=native code runs only where these flags are: they are part of the key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""
