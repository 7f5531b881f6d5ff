"""Projections of a few rows from a GGUF file's own weights, on any CPU.

Every type a GGUF file stores its weights in runs from its blocks as they lie (`GgufRows`,
`gguf_matmul.c`); Q4_0, Q4_1 and Q8_0 weights take the older kernels below over a layout of
their codes repacked at load.

`quant_matmul.c` reads Q4_0 / Q4_1 (`int4.Int4Weight`) and Q8_0 (`int8.Int8Weight`) blocks as
stored, widens the codes in registers and applies each group's scale and minimum once per
row (scale x (x . codes) + minimum x sum(x)); the arithmetic is float32, and an input of one
1 and zeros gives exactly the dense float32 weights the checkpoint dequantizes to. A step of a
few rows (decodes, a request's verify rows) is bound by how fast the weights stream from
memory, and these stream 5 or 8.5 bits a weight where float32 takes 32 and bfloat16 16. Each
row's result is the same at any row count. Built for the widest vectors the CPU has (AVX-512,
AVX2 with FMA and F16C, else plain C).
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_kernels, gguf_kernels
from .gguf_file import release_pages
from .gguf_weight import Q4_0, Q4_1, Q8_0, GgufStack, GgufWeight, Packed
from .int4 import GROUP, Int4Linear, Int4Weight, torch_kernel_available
from .int8 import Int8Weight

# a weight as a GGUF file stores it: its blocks as they lie (`gguf_weight`), or Q4_0 / Q4_1 /
# Q8_0 codes repacked for `quant_matmul.c`'s own layout
Quantized = Int4Weight | Int8Weight | GgufWeight | GgufStack


class QuantRows:
    """y = x W^T + bias for 1 to `max_rows` rows of x (float32 or bfloat16, y the same), W
    packed from its GGUF blocks for `quant_matmul.c`: per block of 2 x lanes outputs and
    group of 32 inputs, the float16 scales, (4-bit) the float16 minimums, then the codes."""

    def __init__(
        self, packed: torch.Tensor, bits: int, shape: tuple[int, int], paired: bool = False
    ) -> None:
        """`paired`: codes paired for bfloat16 rows (`from_int4`, `from_int8`)."""
        kernel = cpu_kernels.quant_matmul()
        assert kernel is not None
        if paired and not kernel.paired:
            raise ValueError("this build has no bfloat16 product over paired codes")
        self.kernel, self.max_rows = kernel, kernel.max_rows
        self.packed, self.bits, self.shape, self.paired = packed, bits, shape, paired
        # the arguments that never change set once: a call sets x's, y's and the bias's
        self._call = self.weight_call()
        self._call_ref = ctypes.byref(self._call)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight a product reads."""
        return self.packed.nbytes

    def weight_call(self) -> cpu_kernels.QuantCall:
        """A fresh `QuantCall` with this weight's arguments set (its bytes, shape, bits and
        layout); the caller sets the rows', the output's, the bias's and the element type."""
        return cpu_kernels.QuantCall(
            cols=self.shape[1], w=self.packed.data_ptr(), outputs=self.shape[0], bits=self.bits,
            paired=self.paired,
        )  # fmt: skip

    @classmethod
    def from_int4(cls, weight: Int4Weight, paired: bool = False) -> QuantRows | None:
        """The kernel over `weight`, or None: no kernel built, or constants that are not
        float16 values (GGUF's always are). `paired`: for bfloat16 rows only, each pair of
        inputs' codes side by side for `quant_paired.c` (where `kernel.paired`)."""
        kernel = cpu_kernels.quant_matmul()
        if kernel is None or not weight.constants_are_float16():
            return None
        rows, cols = weight.shape
        lanes = kernel.lanes
        codes = _padded(weight.unpacked_codes().to(torch.uint8), 2 * lanes)
        blocks = codes.shape[0] // (2 * lanes)
        # [block, half, lane, group, k] -> [block, group, k, half, lane]; byte = low | high << 4
        codes = codes.view(blocks, 2, lanes, cols // GROUP, GROUP).permute(0, 3, 4, 1, 2)
        codes = codes[..., 0, :] | codes[..., 1, :] << 4  # [block, group, k, lane]
        if paired:  # [block, group, pair, lane, input of the pair]
            codes = codes.view(blocks, cols // GROUP, GROUP // 2, 2, lanes).transpose(-1, -2)
        codes = codes.reshape(blocks, cols // GROUP, -1)
        constants = [_half_bytes(t, blocks, lanes) for t in (weight.scale, weight.minimum)]
        packed = torch.cat([*constants, codes], dim=-1).contiguous()
        return cls(packed, 4, (rows, cols), paired)

    @classmethod
    def from_int8(cls, weight: Int8Weight, paired: bool = False) -> QuantRows | None:
        """The kernel over Q8_0 `weight`, or None: no kernel built, or scales that are not
        float16 values (GGUF's always are). `paired` as `from_int4`'s."""
        kernel = cpu_kernels.quant_matmul()
        if kernel is None or not weight.scale_is_float16():
            return None
        codes, scale = weight
        rows, cols = codes.shape
        lanes = kernel.lanes
        padded = _padded(codes.view(torch.uint8), 2 * lanes)
        blocks = padded.shape[0] // (2 * lanes)
        # [block, output, group, k] -> [block, group, k, output]
        padded = padded.view(blocks, 2 * lanes, cols // GROUP, GROUP).permute(0, 2, 3, 1)
        if paired:  # [block, group, pair, output, input of the pair]
            padded = padded.reshape(blocks, cols // GROUP, GROUP // 2, 2, -1).transpose(-1, -2)
        packed = torch.cat(
            [_half_bytes(scale, blocks, lanes), padded.reshape(blocks, cols // GROUP, -1)], dim=-1
        ).contiguous()
        return cls(packed, 8, (rows, cols), paired)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, cols = x.shape
        wide = x.dtype == torch.bfloat16
        if (
            not (wide or x.dtype == torch.float32)
            or cols != self.shape[1]
            or x.stride(1) != 1
            or not 1 <= rows <= self.max_rows
            or (self.paired and not wide)
        ):
            raise ValueError(f"x of {x.dtype} {list(x.shape)} for a {list(self.shape)} weight")
        y = x.new_empty(rows, self.shape[0])
        call = self._call
        call.x, call.x_stride, call.rows = x.data_ptr(), x.stride(0), rows
        call.y, call.y_stride, call.bf16 = y.data_ptr(), self.shape[0], wide
        if bias is not None:
            bias = bias.float().contiguous()  # kept alive to the end of the call
            call.bias = bias.data_ptr()
        else:
            call.bias = None
        if self.kernel.run(self._call_ref) != 0:
            raise ValueError(f"the kernel refused x {list(x.shape)} for {list(self.shape)}")
        return y

    def in_turns(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y for any number (at least 1) of rows, `max_rows` at a time: the same rows as one
        call each, since a row's result does not depend on the rows beside it."""
        most = self.max_rows
        parts = [self(x[i : i + most], bias) for i in range(0, x.shape[0], most)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class GgufRows(QuantRows):
    """y = x W^T + bias for 1 to `max_rows` rows of x (float32 or bfloat16, y the same), W the
    GGUF file's blocks as they lie (`gguf_matmul.c` through `quant_matmul.c`'s entry, which
    `decode_stack.c` calls too), a stack's parts one after the other. The parts whose type is
    in `integer` (`integer_types`) run in the integer mode (`gguf_int8.c`: x rounded to 8 bits
    per block), the others exactly."""

    def __init__(self, weight: Packed, integer: frozenset[int] = frozenset()) -> None:
        self.integer = integer
        kernel = cpu_kernels.quant_matmul()
        assert kernel is not None
        self.parts = weight.parts if isinstance(weight, GgufStack) else (weight,)
        for part in self.parts:
            if part.kind not in gguf_kernels.SUPPORTED or part.data.stride(1) != 1:
                raise ValueError(f"no kernel for a weight of GGML type {part.kind}")
        self.kernel, self.max_rows = kernel, min(kernel.max_rows, gguf_kernels.max_rows())
        self.packed, self.bits, self.paired = self.parts[0].data, 0, False
        self.shape = weight.shape
        self.x8, self._groups = self._repacked()
        # each part after the first as the C side follows it from the one before
        self._rest = [self._part_call(part, i) for i, part in enumerate(self.parts) if i > 0]
        for call, after in zip(self._rest, self._rest[1:], strict=False):
            call.next = ctypes.addressof(after)
        self._call = self.weight_call()
        self._call_ref = ctypes.byref(self._call)

    @property
    def in_integers(self) -> bool:
        """Whether any part runs in the integer mode."""
        return any(p.kind in self.integer for p in self.parts)

    def _repacked(self) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """The integer parts of the K-quants repacked 8 rows at a time (`gguf_int8_x8.c`: the
        same products with half the multiplies), one buffer for all, and each one's view of it
        by part index; the file's pages they were read from given back (the file's blocks stay
        for an embedding lookup or a dequantization, read again where they are needed)."""
        kinds = gguf_kernels.X8_TYPES & self.integer
        chosen = [i for i, p in enumerate(self.parts) if p.kind in kinds]
        if not chosen:
            return None, {}
        shapes = {i: gguf_kernels.x8_shape(self.parts[i].shape[0], self.parts[i].kind,
                                           self.parts[i].cols) for i in chosen}  # fmt: skip
        buffer = torch.empty(sum(a * b for a, b in shapes.values()), dtype=torch.uint8)
        groups, at = {}, 0
        for i in chosen:
            part, shape = self.parts[i], shapes[i]
            view = buffer[at : at + shape[0] * shape[1]].view(shape)
            groups[i] = gguf_kernels.repack_x8(part.data, part.kind, part.cols, out=view)
            release_pages(part.data)
            at += view.numel()
        return buffer, groups

    def _part_call(self, part: GgufWeight, index: int = 0) -> cpu_kernels.QuantCall:
        groups = self._groups.get(index)
        if groups is not None:  # 8 rows at a time
            return cpu_kernels.QuantCall(
                cols=part.cols, w=groups.data_ptr(), outputs=part.shape[0], bits=0,
                gguf_type=gguf_kernels.X8 + part.kind, w_stride=groups.stride(0), int8=1,
            )  # fmt: skip
        return cpu_kernels.QuantCall(
            cols=part.cols, w=part.data.data_ptr(), outputs=part.shape[0], bits=0,
            gguf_type=part.kind, w_stride=part.data.stride(0), int8=int(part.kind in self.integer),
        )  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        x8 = self.x8.nbytes if self.x8 is not None else 0
        return x8 + sum(p.nbytes for i, p in enumerate(self.parts) if i not in self._groups)

    def weight_call(self) -> cpu_kernels.QuantCall:
        call = self._part_call(self.parts[0], 0)
        if self._rest:
            call.next = ctypes.addressof(self._rest[0])
        return call


def as_repacked(weight: Packed) -> Int4Weight | Int8Weight | None:
    """A Q4_0 / Q4_1 / Q8_0 weight's codes (a stack's parts of one such type joined) for
    `quant_matmul.c`'s own layout (and torch's and AMX's 4-bit kernels), tuned for those types
    before the GGUF kernels read every type as it lies; None for other types."""
    if weight.kind not in (Q4_0, Q4_1, Q8_0):
        return None
    if isinstance(weight, GgufStack):
        weight = weight.joined()  # read once into the repacked layout, then dropped
    if weight.kind == Q8_0:
        return Int8Weight.from_blocks(weight.data.numpy())
    return Int4Weight.from_blocks(weight.data.numpy(), with_minimum=weight.kind == Q4_1)


def integer_types(dtype: torch.dtype) -> frozenset[int]:
    """The GGML types the integer mode runs for rows of `dtype`: every type with an integer
    kernel (`gguf_kernels.INT8_TYPES`), but for bfloat16 rows not Q4_0, Q4_1 and Q8_0 where
    their repacked codes have the paired AVX512-BF16 kernel (or AMX's, 4-bit): exact, as fast at
    one row and faster from a few rows on (SmolLM2's Q4_1 step on the AVX512 EPYC, 8 rows: 14.6
    ms against 25.6 in integers; 32 rows: 37.8 against 96.1). A choice per type and server,
    never per batch: a row's result does not depend on the rows beside it."""
    kernel = cpu_kernels.quant_matmul()
    if dtype != torch.bfloat16 or kernel is None:
        return gguf_kernels.INT8_TYPES
    amx = torch_kernel_available(dtype) and cpu_kernels.int4_amx_matmul() is not None
    exact = {Q4_0, Q4_1, Q8_0} if kernel.paired else {Q4_0, Q4_1} if amx else set()
    return gguf_kernels.INT8_TYPES - exact


def quantized_kernel(
    weight: Quantized, dtype: torch.dtype, integer: bool = False
) -> Int4Linear | QuantRows | None:
    """The kernel a CPU projection of `dtype` runs `weight` with, or None (dense only).

    A GGUF weight of Q4_0, Q4_1 or Q8_0 takes the kernels below through its repacked codes;
    every other type the file's blocks as they lie (`GgufRows`), float32 and bfloat16 rows.
    `integer` (`--gguf-arithmetic integer`): the types of `integer_types(dtype)` run in the
    integer mode from the file's blocks instead (Q4_0, Q4_1 and Q8_0 too where it takes them,
    not repacked).

    bfloat16 4-bit weights where the CPU has AMX: torch's 4-bit kernel and AMX's
    (`int4.Int4Linear`, faster there past a few rows); else `quant_matmul.c` for float32 and
    bfloat16 rows, 4- and 8-bit (bfloat16 rows on paired codes where the build has
    `quant_paired.c`), or torch's 4-bit kernel for bfloat16 where that is not built.
    """
    kinds = integer_types(dtype) if integer else frozenset()
    if isinstance(weight, GgufWeight | GgufStack) and weight.kind not in kinds:
        weight = as_repacked(weight) or weight
    if isinstance(weight, GgufWeight | GgufStack):
        parts = weight.parts if isinstance(weight, GgufStack) else (weight,)
        kernel = cpu_kernels.quant_matmul()
        if (
            kernel is None
            or dtype not in (torch.float32, torch.bfloat16)
            or any(p.kind not in gguf_kernels.SUPPORTED for p in parts)
        ):
            return None
        return GgufRows(weight, kinds)
    four_bit = isinstance(weight, Int4Weight)
    torch_kernel = torch_kernel_available(dtype)
    if four_bit and torch_kernel and cpu_kernels.int4_amx_matmul() is not None:
        return Int4Linear(weight)
    if dtype in (torch.float32, torch.bfloat16):
        kernel = cpu_kernels.quant_matmul()
        paired = dtype == torch.bfloat16 and kernel is not None and kernel.paired
        if four_bit:
            quant = QuantRows.from_int4(weight, paired)
        else:
            quant = QuantRows.from_int8(weight, paired)
        if quant is not None:
            return quant
    return Int4Linear(weight) if four_bit and torch_kernel else None


def _padded(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    """`codes` with zero rows added up to a multiple of `multiple` (outputs the kernel
    computes as 0 and does not write)."""
    extra = -codes.shape[0] % multiple
    return torch.cat([codes, codes.new_zeros(extra, codes.shape[1])]) if extra else codes


def _half_bytes(constants: torch.Tensor, blocks: int, lanes: int) -> torch.Tensor:
    """A per-(output, group) float32 constant as float16 bytes [block, group, 2 x 2 x lanes]."""
    halves = _padded(constants.half().view(torch.int16), 2 * lanes)
    halves = halves.view(blocks, 2 * lanes, -1).transpose(1, 2).contiguous()
    return halves.view(torch.uint8).view(blocks, halves.shape[1], -1)
