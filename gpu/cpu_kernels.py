"""CPU kernels written in C, built at first use with the machine's compiler, called by ctypes.

`paged_attention.c` holds decode attention that reads the paged KV cache in place;
`fused_ops.c` the operations between a layer's projections, fused (`FusedOps`); both for
bfloat16 and float32 tensors;
`int4_amx.c` projections from 4-bit weights on Intel AMX (`int4_amx_matmul`);
`quant_matmul.c` projections of a few rows from GGUF's 4- and 8-bit blocks on any CPU
(`quant_matmul`); `decode_stack.c` a decode step's layers, calling the others in turn
(`decode_stack`). All are built
into one library, once per source, compiler and CPU, in `$TRIODE_CACHE/kernels/`
with -O3 -march=native -fopenmp; its OpenMP runtime is the one torch already loaded (the same
soname), so its threads are torch's. Without a C compiler, or with TRIODE_CPU_KERNELS=0,
`paged_decode_attention` and `fused_ops` are None and the model takes the torch path.
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
from typing import Any, NamedTuple

import torch

from .cache_paths import kernels_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = tuple(
    KERNELS / name
    for name in (
        "paged_attention.c", "paged_attention_avx512.c", "fused_ops.c", "int4_amx.c",
        "quant_matmul.c", "quant_paired.c", "decode_stack.c", "gguf_decode.c",
        "gguf_decode_avx2.c", "gguf_dequant.c", "gguf_matmul.c", "gguf_fused_avx2.c",
        "gguf_int8.c", "gguf_int8_x8.c",
    )
)  # fmt: skip
HEADERS = tuple(
    KERNELS / name
    for name in (
        "simd.h", "bf16.h", "elements.h", "group_sum.h", "kernels.h", "gguf_blocks.h",
        "gguf_simd.h", "gguf_avx2.h", "gguf_product.h", "gguf_int8.h",
    )
)  # fmt: skip
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

Kernel = Callable[..., torch.Tensor]

# the element types the attention kernel and the fused ops take, and their C names' suffixes
SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}
FUSED_DTYPES = tuple(SUFFIXES)


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
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TRIODE_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("CPU kernels unavailable (%s); using the torch path", e)
        return None


def _function(name: str, *argtypes: Any, restype: Any = None) -> Any:
    library = _library()
    assert library is not None
    function = getattr(library, name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def paged_decode_attention() -> Kernel | None:
    """The built kernel as `f(q, k_cache, v_cache, block_tables, context_lens, scale, window=0)`,
    or None."""
    library = _library()
    if library is None:
        return None
    functions = {
        dtype: _function(
            f"triode_paged_decode_attention_{suffix}", _P, _I, *[_P] * 5, *[_I] * 6, _F, _I
        )
        for dtype, suffix in SUFFIXES.items()
    }
    max_head_dim, max_heads = library.triode_max_head_dim(), library.triode_max_heads()

    def run(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q [seqs, heads, head_dim] bfloat16 or float32 (the caches' dtype), each sequence's
        heads contiguous (its rows may be apart: a view into the QKV projection's output);
        caches [blocks, block_size, kv_heads, head_dim]; block_tables [seqs, max_blocks] and
        context_lens [seqs] int64; `window`: a sliding window in tokens, each row reading its
        context's last `window` (0: all).
        Returns [seqs, heads, head_dim]."""
        seqs, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if head_dim > max_head_dim or heads > max_heads or heads % kv_heads:
            raise ValueError(f"{heads} heads over {kv_heads} KV heads of {head_dim} not built for")
        if window < 0:
            raise ValueError(f"a sliding window of {window} tokens")
        function = functions.get(k_cache.dtype)
        for t in (k_cache, v_cache):
            if function is None or t.dtype != k_cache.dtype or not t.is_contiguous():
                raise ValueError("the KV cache must be contiguous bfloat16 or float32")
        if q.dtype != k_cache.dtype:
            raise ValueError(f"{q.dtype} queries against a {k_cache.dtype} cache")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        out = q.new_empty(q.shape)
        function(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, head_dim, block_size,
            tables.shape[1], scale, window,
        )  # fmt: skip
        return out

    run.max_heads, run.max_head_dim = max_heads, max_head_dim  # type: ignore[attr-defined]
    return run


class FusedOps:
    """`fused_ops.c`'s kernels on bfloat16 or float32 CPU tensors (see each C function), the
    one for the tensors' dtype."""

    def __init__(self) -> None:
        def each(name: str, *argtypes: Any) -> dict[torch.dtype, Any]:
            return {
                dtype: _function(f"triode_{name}_{suffix}", *argtypes)
                for dtype, suffix in SUFFIXES.items()
            }

        self._norm = each("add_rms_norm", _P, _I, *[_P] * 3, _I, _I, _F, ctypes.c_int)
        self._rope = each("rope_cache", _P, *[_I] * 5, *[_P] * 6)
        self._silu_mul = each("silu_mul", _P, _P, _I, _I)
        self._argmax = each("argmax", _P, _I, _I, _I, _P)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight in x's dtype, x + residual in float32); the sum is made
        in place in `residual` (a fresh float32 copy of x when it is None)."""
        rows, hidden = x.shape
        _check(x, rows, hidden, last_contiguous=True)
        if weight.dtype != x.dtype or weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"a norm weight of {hidden} contiguous {x.dtype} values")
        add = residual is not None
        if residual is None:
            residual = torch.empty(rows, hidden, dtype=torch.float32)
        elif residual.dtype != torch.float32 or not residual.is_contiguous():
            raise ValueError("the residual stream must be contiguous float32")
        out = x.new_empty(rows, hidden)
        self._norm[x.dtype](
            x.data_ptr(), x.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, hidden, eps, int(add),
        )  # fmt: skip
        return out, residual

    def rope_cache(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate qkv's queries and keys in place for `positions` (cos and sin: the float32
        tables [positions, head_dim]) and write its keys and values to cache `slots`."""
        rows, width = qkv.shape
        head_dim = cos.shape[1]
        if width != (num_heads + 2 * num_kv_heads) * head_dim or head_dim > 512 or head_dim % 2:
            raise ValueError(f"qkv of width {width} for {num_heads} + 2 x {num_kv_heads} heads")
        _check(qkv, rows, width, last_contiguous=True)
        for t in (k_cache, v_cache):
            if t.dtype != qkv.dtype or not t.is_contiguous():
                raise ValueError(f"the KV cache must be contiguous {qkv.dtype}")
        for t in (cos, sin):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError("the rotary tables must be contiguous float32")
        positions, slots = (
            positions.to(torch.int64).contiguous(),
            slots.to(torch.int64).contiguous(),
        )
        if len(positions) != rows or len(slots) != rows:
            raise ValueError("one position and one slot per row")
        self._rope[qkv.dtype](
            qkv.data_ptr(), qkv.stride(0), rows, num_heads, num_kv_heads, head_dim,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(),
        )  # fmt: skip

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x = [gate, up] along its last dimension."""
        rows, width = x.shape
        _check(x, rows, width, last_contiguous=False)
        out = x.new_empty(rows, width // 2)
        self._silu_mul[x.dtype](x.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, the first of equals (a NaN counts as the largest), as int64:
        `torch.max(x, -1).indices` in one pass over the values in their own dtype."""
        rows, width = x.shape
        _check(x, rows, width, last_contiguous=True)
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax[x.dtype](x.data_ptr(), rows, width, x.stride(0), out.data_ptr())
        return out


Int4Matmul = Callable[..., int]


@functools.cache
def int4_amx_matmul() -> Int4Matmul | None:
    """`int4_amx.c`'s kernel where this CPU and the compiler's target have AMX (and the
    operating system grants its tile state), else None. See `int4.Int4Linear` for its use."""
    if _library() is None or not _function("triode_int4_amx_available", restype=ctypes.c_int)():
        return None
    return _function(
        "triode_int4_matmul_amx", _P, _I, _I, _I, *[_P] * 4, _I, _P, _I, restype=ctypes.c_int
    )


class QuantCall(ctypes.Structure):
    """One call's arguments to `quant_matmul.c` (its `quant_call`)."""

    _fields_ = [
        ("x", _P), ("x_stride", _I), ("rows", _I), ("cols", _I), ("w", _P), ("bias", _P),
        ("outputs", _I), ("y", _P), ("y_stride", _I), ("bits", ctypes.c_int32),
        ("bf16", ctypes.c_int32), ("paired", ctypes.c_int32), ("gguf_type", ctypes.c_int32),
        ("w_stride", _I), ("next", _P), ("int8", ctypes.c_int32),
    ]  # fmt: skip


class QuantMatmul(NamedTuple):
    """`quant_matmul.c`'s kernel (see `quant_matmul.QuantRows` for its use): `run(byref(call))`
    with a `QuantCall` returns 0 or -1; `lanes` float32 lanes a vector, blocks of 2 x lanes
    outputs; at most `max_rows` rows; `paired`: this build's bfloat16 product over paired
    codes (`quant_paired.c`, AVX512-BF16)."""

    run: Callable[..., int]
    lanes: int
    max_rows: int
    paired: bool


@functools.cache
def quant_matmul() -> QuantMatmul | None:
    """`quant_matmul.c`'s kernel, or None where the library is not built."""
    if _library() is None:
        return None
    run = _function("triode_quant_matmul_call", ctypes.POINTER(QuantCall), restype=ctypes.c_int)
    lanes = _function("triode_quant_lanes", restype=ctypes.c_int)()
    most = _function("triode_quant_max_rows", restype=ctypes.c_int)()
    paired = _function("triode_quant_paired_available", restype=ctypes.c_int)()
    return QuantMatmul(run, lanes, most, bool(paired))


@functools.cache
def decode_stack() -> Callable[..., int] | None:
    """`decode_stack.c`'s entry, `run(byref(step))` with a `decode_stack.DecodeStep`,
    returning 0 or -1; None where the library is not built."""
    if _library() is None:
        return None
    return _function("triode_decode_stack", _P, restype=ctypes.c_int)  # type: ignore[no-any-return]


def _check(x: torch.Tensor, rows: int, width: int, last_contiguous: bool) -> None:
    """bfloat16 or float32 rows of `width` contiguous elements, rows apart by their stride (or,
    without `last_contiguous`, whole and contiguous)."""
    if x.dtype not in SUFFIXES or x.device.type != "cpu":
        raise ValueError("the fused CPU ops take bfloat16 or float32 CPU tensors")
    if last_contiguous and x.stride(1) == 1 and (rows < 2 or x.stride(0) >= width):
        return
    if not x.is_contiguous():
        raise ValueError("the fused CPU ops take contiguous rows")


@functools.cache
def fused_ops() -> FusedOps | None:
    """`fused_ops.c`'s kernels, or None where the library is not built."""
    return FusedOps() if _library() is not None else None


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # TRIODE_KERNEL_FLAGS: more flags after FLAGS, e.g. a test's build without AVX2
    flags = [*FLAGS, *os.environ.get("TRIODE_KERNEL_FLAGS", "").split()]
    key = hashlib.sha256()
    parts = [*(path.read_bytes() for path in (*SOURCES, *HEADERS)), version.encode()]
    for part in (*parts, " ".join(flags).encode(), _cpu_flags()):
        key.update(part)
        key.update(b"\0")
    out = kernels_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
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
