"""`gguf_kernels.matmul_int8`, the integer mode: x rounded to 8 bits per unit (the type's
block: 32 values, or a K-quant's superblock of 256) as documented (`quantize_int8`, against
numpy), the product equal to that rounded x times the file's weights (float64 reference, within
float32 rounding of its terms), a row's result independent of the rows beside it, and, with
`test_gguf_kernels`' builds for narrower targets, the same bits on every build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize
from test_gguf_kernels import OUTPUTS, cols_for, random_blocks, weights

from triode.gpu import gguf_kernels

pytestmark = pytest.mark.skipif(
    not gguf_kernels.available(), reason="no C compiler: the CPU kernels are not built"
)

KINDS = sorted(gguf_kernels.INT8_TYPES)


def unit_of(kind: int) -> int:
    return gguf_kernels.block_size(kind)


def numpy_quantize(x: torch.Tensor, unit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documented rounding, in float32 as the kernel does it: per unit, d = largest |x| /
    127, q = x x (1 / d) rounded to nearest even; the sums of each 16 q."""
    v = x.float().numpy().reshape(x.shape[0], -1, unit)
    with np.errstate(all="ignore"):
        d = np.abs(v).max(axis=2) / np.float32(127)
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.rint(v * inverse[:, :, None]).astype(np.int8)
    sums = q.reshape(x.shape[0], -1, 16).astype(np.int32).sum(axis=2)
    return q.reshape(x.shape), d.astype(np.float32), sums


def _terms(x: torch.Tensor, dense: torch.Tensor, kind: int, magnitude: bool) -> np.ndarray:
    """sum over units of dx x (W's unit . q), or of dx |W| . |q|, in float64."""
    unit = unit_of(kind)
    q, d, _ = numpy_quantize(x, unit)
    rows, cols = q.shape
    q64 = q.astype(np.float64).reshape(rows, cols // unit, unit)
    w64 = dense.double().numpy().reshape(dense.shape[0], cols // unit, unit)
    if magnitude:
        q64, w64 = np.abs(q64), np.abs(w64)
    return np.einsum("ruk,ouk,ru->ro", q64, w64, d.astype(np.float64))


def reference(
    x: torch.Tensor, dense: torch.Tensor, kind: int, bias: torch.Tensor | None
) -> np.ndarray:
    """The rounded x times the file's float weights, in float64."""
    y = _terms(x, dense, kind, magnitude=False)
    return y + (bias.double().numpy() if bias is not None else 0.0)


def assert_integer_product(
    y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, kind: int, bias: torch.Tensor | None
) -> None:
    """y within float32 rounding of its terms of the float64 reference (each term dx |w| |q|,
    rounded a few times: scales, products, sums of ~40 units)."""
    magnitude = _terms(x, dense, kind, magnitude=True)
    error = np.abs(y.double().numpy() - reference(x, dense, kind, bias))
    assert (error <= 2e-6 * magnitude + 1e-30).all(), float((error / magnitude).max())


def products(seed: int = 3) -> dict[int, torch.Tensor]:
    """Each type's integer product of 9 rows with its test matrix, float32 and bfloat16 x, and
    one row alone, and the K-quants' product from their x8 layout: what every build must give
    bit for bit."""
    out = {}
    for kind in KINDS:
        data, _ = weights(kind)
        x = torch.randn(9, cols_for(kind), generator=torch.Generator().manual_seed(seed + kind))
        bias = torch.randn(OUTPUTS, generator=torch.Generator().manual_seed(kind))
        y = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS, bias)
        y16 = gguf_kernels.matmul_int8(x.to(torch.bfloat16), data, kind, OUTPUTS, bias)
        one = gguf_kernels.matmul_int8(x[4:5], data, kind, OUTPUTS, bias)
        out[kind] = torch.cat([y, y16.float(), one])
        if kind in gguf_kernels.X8_TYPES:  # the x8 layout, repacked by this build too
            x8 = gguf_kernels.repack_x8(data, kind, cols_for(kind))
            grouped = gguf_kernels.matmul_int8(x, x8, gguf_kernels.X8 + kind, OUTPUTS, bias)
            out[gguf_kernels.X8 + kind] = grouped
    return out


def save_products(path: str) -> None:
    """`products()` to `path`, for a build of another target to be compared with this one."""
    torch.save({str(k): v for k, v in products().items()}, Path(path))


@pytest.mark.parametrize("unit", [32, 256])
def test_x_is_rounded_to_8_bits_per_unit_as_documented(unit: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1280, generator=generator) * torch.logspace(-30, 30, 1280)
    x[1, unit : 2 * unit] = 0.0  # a unit of zeros: scale 0, codes 0
    x[2, :32] = torch.tensor([1.0, -1.0] * 16) * 127 / 2  # halves: ties to even
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        q, d, s = gguf_kernels.quantize_int8(rows, unit)
        want_q, want_d, want_s = numpy_quantize(rows, unit)
        assert d.shape == (5, 1280 // unit) and s.shape == (5, 80)
        assert np.array_equal(q.numpy(), want_q)
        assert np.array_equal(d.numpy().view(np.uint32), want_d.view(np.uint32))
        assert np.array_equal(s.numpy(), want_s)
        assert int(q.abs().max()) <= 127
    assert float(d[1, 1]) == 0.0 and not q[1, unit : 2 * unit].any()


def test_a_unit_with_a_nan_or_an_infinity_makes_its_outputs_nan() -> None:
    kind = int(GGMLQuantizationType.Q4_K)
    data, _ = weights(kind)
    x = torch.randn(3, cols_for(kind))
    x[0, 5], x[2, 700] = float("nan"), float("inf")
    y = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS)
    assert y[0].isnan().all() and y[2].isnan().all() and not y[1].isnan().any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_the_product_is_the_rounded_x_times_the_files_weights(
    kind: int, rows: int, with_bias: bool
) -> None:
    data, dense = weights(kind)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols_for(kind), generator=generator)
    bias = torch.randn(OUTPUTS, generator=generator) if with_bias else None
    y = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS, bias)
    assert y.shape == (rows, OUTPUTS) and y.dtype == torch.float32
    assert_integer_product(y, x, dense, kind, bias)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_rows_round_the_result_once(kind: int) -> None:
    data, _ = weights(kind)
    x = torch.randn(3, cols_for(kind)).to(torch.bfloat16)
    y = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS)
    want = gguf_kernels.matmul_int8(x.float(), data, kind, OUTPUTS).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: int) -> None:
    data, _ = weights(kind)
    x = torch.randn(64, cols_for(kind), generator=torch.Generator().manual_seed(1))
    whole = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS)
    for first, n in [(0, 1), (63, 1), (3, 3), (1, 5), (2, 9)]:
        part = gguf_kernels.matmul_int8(x[first : first + n], data, kind, OUTPUTS)
        assert torch.equal(part.view(torch.int32), whole[first : first + n].view(torch.int32))


def test_the_integer_mode_differs_from_the_exact_one_by_x_s_rounding_alone() -> None:
    # each x moves by at most half its unit's step, dx / 2: the product by at most the sum
    # over units of dx / 2 x (the unit's sum of |w|), and by the two modes' float rounding
    for kind in KINDS:
        data, dense = weights(kind)
        unit = unit_of(kind)
        x = torch.randn(4, cols_for(kind), generator=torch.Generator().manual_seed(kind))
        exact = gguf_kernels.matmul(x, data, kind, OUTPUTS).double()
        integer = gguf_kernels.matmul_int8(x, data, kind, OUTPUTS).double()
        _, d, _ = numpy_quantize(x, unit)
        units = dense.double().abs().reshape(OUTPUTS, -1, unit).sum(dim=2)  # [outputs, units]
        bound = 0.5 * torch.from_numpy(d).double() @ units.T
        rounding = 1e-5 * (x.double().abs() @ dense.double().abs().T)
        assert ((integer - exact).abs() <= bound + rounding).all(), kind
        assert not torch.equal(integer, exact)  # a test that can fail


def test_types_without_an_integer_kernel_are_refused() -> None:
    kind = int(GGMLQuantizationType.Q3_K)
    data, _ = weights(kind)
    with pytest.raises(ValueError, match="no integer kernel"):
        gguf_kernels.matmul_int8(torch.randn(1, cols_for(kind)), data, kind, OUTPUTS)
    with pytest.raises(ValueError, match="units of 32"):
        gguf_kernels.quantize_int8(torch.randn(2, 40))
    with pytest.raises(ValueError, match="units of 256"):
        gguf_kernels.quantize_int8(torch.randn(2, 320), 256)
    with pytest.raises(ValueError, match="32 or 256"):
        gguf_kernels.quantize_int8(torch.randn(2, 64), 64)


def test_bfloat16_rows_keep_the_exact_kernels_where_they_are_as_fast() -> None:
    """Q4_0, Q4_1 and Q8_0 take their repacked paired kernel for bfloat16 rows where the build
    has one (exact, and faster from a few rows on); float32 rows and the other types take the
    integer mode from the file's blocks. Per type and dtype, never per batch."""
    from triode.gpu import cpu_kernels
    from triode.gpu.gguf_weight import GgufWeight
    from triode.gpu.quant_matmul import GgufRows, integer_types, quantized_kernel

    assert integer_types(torch.float32) == gguf_kernels.INT8_TYPES
    paired = getattr(cpu_kernels.quant_matmul(), "paired", False)
    repackable = {int(GGMLQuantizationType[n]) for n in ("Q4_0", "Q4_1", "Q8_0")}
    dense = np.random.default_rng(0).standard_normal((176, 512)).astype(np.float32)
    for kind in KINDS:  # the paired kernel's shapes; a model's scales (float16 as repacked)
        if kind in repackable:
            blocks = quantize(dense, GGMLQuantizationType(kind))
        else:
            blocks = random_blocks(kind, 176, 512, seed=kind)
        weight = GgufWeight(torch.from_numpy(blocks.reshape(176, -1)), kind, 512)
        in_float32 = quantized_kernel(weight, torch.float32, integer=True)
        assert isinstance(in_float32, GgufRows) and in_float32.in_integers
        in_bfloat16 = quantized_kernel(weight, torch.bfloat16, integer=True)
        exact = paired and kind in repackable
        assert (kind in integer_types(torch.bfloat16)) != exact
        assert isinstance(in_bfloat16, GgufRows) != exact
        if exact:
            assert in_bfloat16 is not None and in_bfloat16.paired
        else:
            assert isinstance(in_bfloat16, GgufRows) and in_bfloat16.in_integers
