"""`gguf_kernels`: GGUF blocks as the file stores them, against gguf's numpy `dequantize` (bit
for bit) and the dense float32 product over its weights (within float32 rounding), for every
type the kernels take; and the same in a build without AVX2."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize

from triode.gpu import cpu_kernels, gguf_kernels
from triode.gpu.bench import gguf_kernels as bench

pytestmark = pytest.mark.skipif(
    not gguf_kernels.available(), reason="no C compiler: the CPU kernels are not built"
)

KINDS = sorted(gguf_kernels.SUPPORTED)
FLOAT_KINDS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# byte offsets of each block's float16 fields (scales, minimums)
HALVES = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.IQ4_NL: (0,),
    GGMLQuantizationType.IQ4_XS: (0,),
}
# scale fields: subnormal halves, the largest, zeros of both signs, ordinary values
FINITE = (2.0**-20, 2.0**-24, 30000.0, -65504.0, 0.0, -0.0, 0.01, -0.003, 1.5, 0.02)
NON_FINITE = (float("inf"), float("-inf"), float("nan"))
OUTPUTS = 37  # not whole tiles of outputs


def cols_for(kind: int) -> int:
    """A row that ends in part of a chunk (1024 weights): a superblock past one chunk; 41
    32-weight blocks (an odd count); for the float types, part of a 32-weight unit."""
    return {256: 1280, 32: 1312, 1: 1000}[gguf_kernels.block_size(kind)]


def random_blocks(
    kind: int, rows: int, cols: int, seed: int, scales: tuple[float, ...] = FINITE
) -> np.ndarray:
    """Random bytes, every block's float16 fields from `scales`: any codes make a valid block.
    Float types get random finite weights instead (random bytes would be NaNs here and
    there) unless `scales` has non-finite values."""
    rng = np.random.default_rng(seed)
    if kind in FLOAT_KINDS and scales is FINITE:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if kind == GGMLQuantizationType.F16:
            return values.astype(np.float16).view(np.uint8)
        if kind == GGMLQuantizationType.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    size, nbytes = gguf_kernels.block_size(kind), gguf_kernels.block_bytes(kind)
    blocks = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for offset in HALVES.get(kind, ()):
        halves = rng.choice(np.array(scales, np.float16), size=(rows, cols // size, 1))
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, kind: int) -> torch.Tensor:
    with np.errstate(all="ignore"):  # infinite and NaN scales, where a test asks for them
        return torch.from_numpy(numpy_dequantize(data, GGMLQuantizationType(kind)).copy())


@functools.cache
def weights(kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A test matrix of `kind` [OUTPUTS, cols_for(kind)]: its blocks and its float weights."""
    data = random_blocks(kind, OUTPUTS, cols_for(kind), seed=kind)
    return torch.from_numpy(data), reference(data, kind)


def assert_same_floats(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits wherever `want` is a number, and NaN wherever it is one."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bits = torch.int32 if want.dtype == torch.float32 else torch.int16
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def assert_within_rounding(
    y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """|y - x W^T - b| <= 2e-6 (|x| |W|^T + |b|): a few float32 roundings of the terms."""
    x64, w64 = x.double(), dense.double()
    want, scale = x64 @ w64.T, x64.abs() @ w64.abs().T
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    assert ((y.double() - want).abs() <= 2e-6 * scale).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_block_sizes_are_ggufs_and_the_librarys(kind: int) -> None:
    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    library = cpu_kernels._library()
    assert (gguf_kernels.block_size(kind), gguf_kernels.block_bytes(kind)) == (size, nbytes)
    assert (library.triode_gguf_block_size(kind), library.triode_gguf_block_bytes(kind)) == (
        size,
        nbytes,
    )
    assert gguf_kernels.row_bytes(kind, 4 * size) == 4 * nbytes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scales", [FINITE, FINITE + NON_FINITE], ids=["finite", "inf-nan"])
def test_dequantize_is_numpys_bit_for_bit(kind: int, scales: tuple[float, ...]) -> None:
    cols = cols_for(kind)
    data = random_blocks(kind, 9, cols, seed=100 + kind, scales=scales)
    assert_same_floats(
        gguf_kernels.dequantize(torch.from_numpy(data), kind, cols), reference(data, kind)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_reads_rows_a_stride_apart(kind: int) -> None:
    cols = cols_for(kind)
    data = random_blocks(kind, 6, 2 * cols, seed=200 + kind)
    rows = torch.from_numpy(data)[:, : gguf_kernels.row_bytes(kind, cols)]  # every other half
    want = reference(np.ascontiguousarray(rows.numpy()), kind)
    assert_same_floats(gguf_kernels.dequantize(rows, kind, cols), want)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_is_the_dequantized_rows(kind: int) -> None:
    data, dense = weights(kind)
    ids = torch.tensor([5, 0, 36, 5, 17])
    got = gguf_kernels.gather(data, kind, cols_for(kind), ids)
    assert_same_floats(got, dense[ids])
    assert gguf_kernels.gather(data, kind, cols_for(kind), ids[:0]).shape == (0, cols_for(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_weights_are_the_float32_ones_rounded(kind: int) -> None:
    cols = cols_for(kind)
    data = torch.from_numpy(
        random_blocks(kind, 9, cols, seed=300 + kind, scales=FINITE + NON_FINITE)
    )
    want = gguf_kernels.dequantize(data, kind, cols).to(torch.bfloat16)
    assert_same_floats(gguf_kernels.dequantize(data, kind, cols, torch.bfloat16), want)
    ids = torch.tensor([8, 1])
    assert_same_floats(gguf_kernels.gather(data, kind, cols, ids, torch.bfloat16), want[ids])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_matmul_is_the_dense_float32_product_within_rounding(
    kind: int, rows: int, with_bias: bool
) -> None:
    data, dense = weights(kind)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols_for(kind), generator=g)
    bias = torch.randn(OUTPUTS, generator=g) if with_bias else None
    y = gguf_kernels.matmul(x, data, kind, OUTPUTS, bias)
    assert y.shape == (rows, OUTPUTS) and y.dtype == torch.float32
    assert_within_rounding(y, x, dense, bias)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: int) -> None:
    # up to 8 rows decode in registers, more share a decoded chunk: the same sums either way
    data, _ = weights(kind)
    x = torch.randn(64, cols_for(kind), generator=torch.Generator().manual_seed(1))
    bias = torch.randn(OUTPUTS)
    whole = gguf_kernels.matmul(x, data, kind, OUTPUTS, bias)
    for first, n in [(0, 1), (5, 1), (63, 1), (0, 2), (3, 3), (0, 4), (1, 5), (8, 8), (2, 9)]:
        part = gguf_kernels.matmul(x[first : first + n], data, kind, OUTPUTS, bias)
        assert torch.equal(part.view(torch.int32), whole[first : first + n].view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_bfloat16_rows_round_the_float32_result_once(kind: int, rows: int) -> None:
    data, _ = weights(kind)
    x = torch.randn(rows, cols_for(kind), generator=torch.Generator().manual_seed(2))
    x16, bias = x.to(torch.bfloat16), torch.randn(OUTPUTS)
    y = gguf_kernels.matmul(x16, data, kind, OUTPUTS, bias)
    want = gguf_kernels.matmul(x16.float(), data, kind, OUTPUTS, bias).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    ulps = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1


def test_matmul_writes_into_out_and_reads_strided_rows() -> None:
    kind = int(GGMLQuantizationType.Q4_K)
    data, dense = weights(kind)
    wide = torch.zeros(OUTPUTS, 2 * data.shape[1], dtype=torch.uint8)
    wide[:, : data.shape[1]] = data
    x = torch.randn(3, 2 * cols_for(kind))[:, : cols_for(kind)]  # rows apart by their stride
    out = torch.full((3, OUTPUTS + 5), float("nan"))[:, :OUTPUTS]
    y = gguf_kernels.matmul(x, wide[:, : data.shape[1]], kind, OUTPUTS, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_within_rounding(out, x, dense, None)


Q4_K = int(GGMLQuantizationType.Q4_K)
_matmul, _gather, _dequantize = gguf_kernels.matmul, gguf_kernels.gather, gguf_kernels.dequantize
BAD_CALLS = {
    "no rows": (lambda x, w: _matmul(x[:0], w, Q4_K, OUTPUTS), ValueError),
    "65 rows": (lambda x, w: _matmul(x.repeat(33, 1), w, Q4_K, OUTPUTS), ValueError),
    "float64 x": (lambda x, w: _matmul(x.double(), w, Q4_K, OUTPUTS), ValueError),
    "too few columns": (lambda x, w: _matmul(x[:, :1024], w, Q4_K, OUTPUTS), ValueError),
    "part of a block": (lambda x, w: _matmul(x[:, :1000], w, Q4_K, OUTPUTS), ValueError),
    "column stride": (lambda x, w: _matmul(x.t().contiguous().t(), w, Q4_K, OUTPUTS), ValueError),
    "outputs": (lambda x, w: _matmul(x, w, Q4_K, OUTPUTS - 1), ValueError),
    "int8 blocks": (lambda x, w: _matmul(x, w.view(torch.int8), Q4_K, OUTPUTS), ValueError),
    "another type's rows": (lambda x, w: _matmul(x, w, Q4_K + 1, OUTPUTS), ValueError),
    "type not taken": (lambda x, w: _matmul(x, w, 9, OUTPUTS), ValueError),
    "float16 bias": (lambda x, w: _matmul(x, w, Q4_K, OUTPUTS, x[0, :OUTPUTS].half()), ValueError),
    "out's shape": (lambda x, w: _matmul(x, w, Q4_K, OUTPUTS, out=x[:2, :OUTPUTS]), ValueError),
    "float16 weights": (lambda x, w: _dequantize(w, Q4_K, 1280, torch.float16), ValueError),
    "id past the rows": (lambda x, w: _gather(w, Q4_K, 1280, torch.tensor([OUTPUTS])), IndexError),
    "negative id": (lambda x, w: _gather(w, Q4_K, 1280, torch.tensor([-1])), IndexError),
    "float ids": (lambda x, w: _gather(w, Q4_K, 1280, torch.tensor([1.0])), ValueError),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_arguments_the_kernels_do_not_take_raise_before_the_call(case: str) -> None:
    call, error = BAD_CALLS[case]
    data, _ = weights(Q4_K)
    with pytest.raises(error):
        call(torch.randn(3, 1280), data)


def test_the_benchmark_times_each_type_beside_torch(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--types", "Q4_K", "Q8_0", "--rows", "1", "--shapes", "64x512", "--calls", "1"]
    assert bench.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines[1:]] == ["Q4_K", "Q8_0", "torch dense"]


def check_every_type() -> None:
    """What a build of another target must get right: every type's weights bit for bit, and
    its products within rounding by both paths (in registers up to 8 rows, then chunks)."""
    for kind in KINDS:
        data, dense = weights(kind)
        assert_same_floats(gguf_kernels.dequantize(data, kind, cols_for(kind)), dense)
        x = torch.randn(9, cols_for(kind), generator=torch.Generator().manual_seed(kind))
        y = gguf_kernels.matmul(x, data, kind, OUTPUTS)
        assert_within_rounding(y, x, dense, None)
        assert torch.equal(gguf_kernels.matmul(x[:1], data, kind, OUTPUTS), y[:1])


def _cpu_flags() -> set[str]:
    return set(cpu_kernels._cpu_flags().decode().partition(":")[2].split())


# a build for each narrower x86 target this CPU runs: the plain C paths, and AVX2 alone
# where the CPU has AVX-512 (and AVX-512 without its bfloat16 instructions)
BUILDS = {
    "portable": ("-mno-avx2 -mno-fma -mno-f16c -mno-avx512f", "avx"),
    "avx2": ("-mno-avx512f", "avx512f"),
    "no-avx512bf16": ("-mno-avx512bf16", "avx512_bf16"),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_a_build_for_a_narrower_target_is_as_exact(build: str, tmp_path: Path) -> None:
    flags, needs = BUILDS[build]
    if needs not in _cpu_flags():
        pytest.skip(f"this CPU has no {needs}: the build would be the native one")
    env = {**os.environ, "TRIODE_CACHE": str(tmp_path), "TRIODE_KERNEL_FLAGS": flags}
    saved = tmp_path / "int8.pt"
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_gguf_kernels as t, test_gguf_int8 as i; t.check_every_type(); "
        f"i.save_products({str(saved)!r}); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
    assert len(list((tmp_path / "kernels").glob("cpu_kernels-*.so"))) == 1
    # the integer mode: the same bits as this build's (its float terms in one order)
    from test_gguf_int8 import products

    theirs = torch.load(saved)
    for kind, ours in products().items():
        assert torch.equal(theirs[str(kind)].view(torch.int32), ours.view(torch.int32)), kind
