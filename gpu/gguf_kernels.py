"""GGUF's weight blocks as the file stores them, row-major, on the CPU (`kernels/gguf_*.c`):
float weights bit for bit as gguf's numpy `dequantize` makes them (`dequantize`, and
`gather` for an embedding lookup), and the product of a few rows with the weights without
dequantizing them (`matmul`, a decode step's projections; `matmul_int8`, the same in integer
arithmetic over x rounded to 8 bits, llama.cpp's way, for the types in `INT8_TYPES`).

`kind` is the tensor's `gguf.GGMLQuantizationType` as an int; the weights are a uint8 tensor
[rows, row_bytes(kind, cols)], each row's bytes contiguous. Every argument is checked here,
before the C call, where a wrong shape would be a wrong pointer.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch

from . import cpu_kernels

# type id: (weights a block, bytes a block), as gguf.GGML_QUANT_SIZES has them
_BLOCKS = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    20: (32, 18),  # IQ4_NL
    23: (256, 136),  # IQ4_XS
    30: (1, 2),  # BF16
}
SUPPORTED: frozenset[int] = frozenset(_BLOCKS)
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
INT8_TYPES: frozenset[int] = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
# the K-quants' x8 layout (`repack_x8`), GGML type X8 + the file's: bytes of 8 rows' superblock
X8 = 256
_X8_BYTES = {12: 1184, 13: 1440, 14: 1680}
X8_TYPES: frozenset[int] = frozenset(_X8_BYTES)
_DTYPES = (torch.float32, torch.bfloat16)


def block_size(kind: int) -> int:
    """Weights a block of type `kind`."""
    return _blocks(kind)[0]


def block_bytes(kind: int) -> int:
    """Bytes a block of type `kind`."""
    return _blocks(kind)[1]


def row_bytes(kind: int, cols: int) -> int:
    """Bytes a row of `cols` weights of type `kind` takes."""
    size, nbytes = _blocks(kind)
    if cols < 1 or cols % size:
        raise ValueError(f"{cols} weights are not whole blocks of {size}")
    return cols // size * nbytes


def available() -> bool:
    """Whether the CPU kernels' library is built (else every call here raises)."""
    return _functions() is not None


class _Functions(NamedTuple):
    dequantize: Any
    gather: Any
    matmul: Any
    matmul_int8: Any
    quantize_int8: Any
    repack_x8: Any
    max_rows: int


@functools.cache
def _functions() -> _Functions | None:
    if cpu_kernels._library() is None:
        return None
    p, i, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function = functools.partial(cpu_kernels._function, restype=c_int)
    return _Functions(
        dequantize=function("triode_gguf_dequantize", c_int, p, i, i, i, p, i, c_int),
        gather=function("triode_gguf_gather", c_int, p, i, i, p, i, p, i, c_int),
        matmul=function("triode_gguf_matmul", c_int, p, i, i, i, p, i, i, p, p, i, c_int),
        matmul_int8=function("triode_gguf_matmul_int8", c_int, p, i, i, i, p, i, i, p, p, i, c_int),
        quantize_int8=function("triode_gguf_quantize_int8", p, i, i, i, i, c_int, p, p, p),
        repack_x8=function("triode_gguf_repack_x8", c_int, p, i, i, i, p),
        max_rows=function("triode_gguf_max_rows")(),
    )


def max_rows() -> int:
    """The most rows of x one `matmul` takes."""
    return _library().max_rows


def dequantize(
    data: torch.Tensor, kind: int, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weights [rows, cols] (float32 or bfloat16) of `data`'s rows of blocks."""
    functions = _library()
    _check_blocks(data, kind, cols)
    out = torch.empty(data.shape[0], cols, dtype=_out_dtype(dtype))
    status = functions.dequantize(
        kind, data.data_ptr(), data.stride(0), data.shape[0], cols, out.data_ptr(), cols,
        int(dtype == torch.bfloat16),
    )  # fmt: skip
    _ok(status)
    return out


def gather(
    data: torch.Tensor,
    kind: int,
    cols: int,
    ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows `ids` (int64 [n]) of `dequantize(data, kind, cols, dtype)`, those alone decoded: an
    embedding lookup."""
    functions = _library()
    _check_blocks(data, kind, cols)
    if ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
        raise ValueError("ids must be a 1-D int64 CPU tensor")
    ids = ids.contiguous()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= data.shape[0]):
        raise IndexError(f"ids outside the {data.shape[0]} rows")
    out = torch.empty(len(ids), cols, dtype=_out_dtype(dtype))
    status = functions.gather(
        kind, data.data_ptr(), data.stride(0), cols, ids.data_ptr(), len(ids), out.data_ptr(),
        cols, int(dtype == torch.bfloat16),
    )  # fmt: skip
    _ok(status)
    return out


def matmul(
    x: torch.Tensor,
    data: torch.Tensor,
    kind: int,
    outputs: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias): x [n, cols] float32 or bfloat16 (n from 1 to `max_rows()`, each row
    contiguous), W `outputs` rows of blocks in `data`, bias float32 [outputs]. Returns y
    [n, outputs] in x's dtype, written into `out` where given (rows contiguous)."""
    return _product(_library().matmul, x, data, kind, outputs, bias, out)


def matmul_int8(
    x: torch.Tensor,
    data: torch.Tensor,
    kind: int,
    outputs: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`matmul` in integer arithmetic (`kind` in `INT8_TYPES`): each unit of x as long as the
    type's block (32 values against Q8_0, a superblock of 256 against the K-quants) rounded to
    8 bits with a scale of its own (`quantize_int8`), multiplied by the weights' codes and
    integer scales in integers; the float terms added in one order on every build."""
    if kind not in INT8_TYPES and kind - X8 not in X8_TYPES:
        raise ValueError(f"GGML type {kind} has no integer kernel")
    return _product(_library().matmul_int8, x, data, kind, outputs, bias, out)


def x8_shape(rows: int, kind: int, cols: int) -> tuple[int, int]:
    """The shape of `repack_x8`'s result for `rows` rows."""
    return (rows + 7) // 8, row_bytes(X8 + kind, cols)


def repack_x8(
    data: torch.Tensor, kind: int, cols: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`data`'s rows of K-quant `kind` (`X8_TYPES`) repacked 8 rows at a time for
    `matmul_int8(x, repacked, X8 + kind, rows)` (`gguf_int8_x8.c`): uint8 `x8_shape(...)`
    (written into `out` where given, contiguous), the last group's missing rows zero. The same
    products to the bit, with half the multiplies."""
    functions = _library()
    if kind not in X8_TYPES:
        raise ValueError(f"GGML type {kind} has no x8 layout")
    _check_blocks(data, kind, cols)
    shape = x8_shape(data.shape[0], kind, cols)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif out.shape != shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor {list(shape)}")
    status = functions.repack_x8(
        kind, data.data_ptr(), data.stride(0), data.shape[0], cols, out.data_ptr()
    )
    _ok(status)
    return out


def quantize_int8(
    x: torch.Tensor, unit: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, cols] (float32 or bfloat16, cols whole units) as `matmul_int8` rounds it against
    a type with blocks of `unit` values (32 or 256: `block_size(kind)`): codes int8 [n, cols],
    each unit's scale float32 [n, cols / unit] (its largest magnitude over 127) and each 16
    codes' sum int32 [n, cols / 16]."""
    functions = _library()
    if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError("x must be a 2-D float32 or bfloat16 CPU tensor, rows contiguous")
    rows, cols = x.shape
    if unit not in (32, 256):
        raise ValueError(f"unit must be 32 or 256, not {unit}")
    if rows < 1 or cols < unit or cols % unit:
        raise ValueError(f"x [{rows}, {cols}]: cols must be whole units of {unit}")
    q = torch.empty(rows, cols, dtype=torch.int8)
    dx = torch.empty(rows, cols // unit)
    s = torch.empty(rows, cols // 16, dtype=torch.int32)
    status = functions.quantize_int8(
        x.data_ptr(), x.stride(0), rows, cols, unit, int(x.dtype == torch.bfloat16),
        q.data_ptr(), dx.data_ptr(), s.data_ptr(),
    )  # fmt: skip
    _ok(status)
    return q, dx, s


def _product(
    function: Any,
    x: torch.Tensor,
    data: torch.Tensor,
    kind: int,
    outputs: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`function` (a product's C entry) called on arguments checked as `matmul` documents."""
    functions = _library()
    if x.dtype not in _DTYPES or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError("x must be a 2-D float32 or bfloat16 CPU tensor")
    rows, cols = x.shape
    if not 1 <= rows <= functions.max_rows:
        raise ValueError(f"{rows} rows; the kernel takes 1 to {functions.max_rows}")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    _check_blocks(data, kind, cols)
    if data.shape[0] != (outputs if kind < X8 else (outputs + 7) // 8):
        raise ValueError(f"{data.shape[0]} rows of weights for {outputs} outputs")
    if bias is not None and (
        bias.dtype != torch.float32
        or bias.shape != (outputs,)
        or not bias.is_contiguous()
        or bias.device.type != "cpu"
    ):
        raise ValueError(f"bias must be {outputs} contiguous float32 values on the CPU")
    if out is None:
        out = x.new_empty(rows, outputs)
    elif out.dtype != x.dtype or out.shape != (rows, outputs) or out.device.type != "cpu":
        raise ValueError(f"out must be a {x.dtype} CPU tensor [{rows}, {outputs}]")
    elif outputs > 1 and out.stride(1) != 1:
        raise ValueError("out's rows must be contiguous")
    status = function(
        kind, x.data_ptr(), x.stride(0), rows, cols, data.data_ptr(), data.stride(0), outputs,
        bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
        int(x.dtype == torch.bfloat16),
    )  # fmt: skip
    _ok(status)
    return out


def _blocks(kind: int) -> tuple[int, int]:
    if kind - X8 in X8_TYPES:  # an x8 group's superblock
        return 256, _X8_BYTES[kind - X8]
    try:
        return _BLOCKS[kind]
    except KeyError:
        raise ValueError(f"GGML type {kind} is not one these kernels take") from None


def _library() -> _Functions:
    functions = _functions()
    if functions is None:
        raise RuntimeError("the CPU kernels are not built (no C compiler, or disabled)")
    return functions


def _check_blocks(data: torch.Tensor, kind: int, cols: int) -> None:
    """`data`: uint8 CPU rows of `cols` weights of type `kind`, each row's bytes contiguous."""
    nbytes = row_bytes(kind, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.device.type != "cpu":
        raise ValueError("the blocks must be a 2-D uint8 CPU tensor")
    if data.shape[1] != nbytes:
        raise ValueError(f"rows of {data.shape[1]} bytes, where {cols} weights take {nbytes}")
    if data.stride(1) != 1:
        raise ValueError("each row's bytes must be contiguous")


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"weights come as float32 or bfloat16, not {dtype}")
    return dtype


def _ok(status: int) -> None:
    if status != 0:
        raise ValueError("the kernel refused its arguments")
