"""The integer mode's x8 layout of the K-quants (`gguf_kernels.repack_x8`, `gguf_int8_x8.c`):
8 rows' superblocks interleaved, whose product equals the row layout's to the bit at every row
count and output count (the row layout's product is checked against a float64 reference in
`test_gguf_int8`), and the file's pages given back once a weight is repacked."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_kernels import random_blocks

from triode.gpu import gguf_file, gguf_kernels

pytestmark = pytest.mark.skipif(
    not gguf_kernels.available(), reason="no C compiler: the CPU kernels are not built"
)

KINDS = sorted(gguf_kernels.X8_TYPES)
COLS = 1280  # five superblocks


def blocks(kind: int, rows: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(kind, rows, COLS, seed=seed + kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("outputs", [8, 37, 64])
def test_the_x8_layout_gives_the_row_layouts_products_to_the_bit(kind: int, outputs: int) -> None:
    data = blocks(kind, outputs)
    x8 = gguf_kernels.repack_x8(data, kind, COLS)
    assert (
        x8.shape == gguf_kernels.x8_shape(outputs, kind, COLS) == ((outputs + 7) // 8, x8.shape[1])
    )
    generator = torch.Generator().manual_seed(outputs)
    bias = torch.randn(outputs, generator=generator)
    for rows in (1, 2, 3, 4, 5, 9, 64):
        x = torch.randn(rows, COLS, generator=generator) * 3
        for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
            want = gguf_kernels.matmul_int8(x.to(dtype), data, kind, outputs, bias)
            got = gguf_kernels.matmul_int8(x.to(dtype), x8, gguf_kernels.X8 + kind, outputs, bias)
            assert torch.equal(got.view(bits), want.view(bits)), (rows, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_of_a_group_is_its_own(kind: int) -> None:
    # a weight row changed changes its output alone: the interleaving keeps rows apart
    data = blocks(kind, 16)
    x = torch.randn(3, COLS)
    before = gguf_kernels.matmul_int8(x, gguf_kernels.repack_x8(data, kind, COLS), 256 + kind, 16)
    changed = data.clone()
    changed[5] = blocks(kind, 1, seed=99)[0]
    after = gguf_kernels.matmul_int8(x, gguf_kernels.repack_x8(changed, kind, COLS), 256 + kind, 16)
    moved = (after != before).any(dim=0)
    assert moved[5] and not moved[torch.arange(16) != 5].any()


def test_the_last_groups_missing_rows_are_zero_and_bad_arguments_are_refused() -> None:
    kind = int(GGMLQuantizationType.Q4_K)
    x8 = gguf_kernels.repack_x8(blocks(kind, 9), kind, COLS)
    padded = gguf_kernels.repack_x8(
        torch.cat([blocks(kind, 9), torch.zeros(7, 720, dtype=torch.uint8)]), kind, COLS
    )
    assert torch.equal(x8, padded)
    with pytest.raises(ValueError, match="no x8 layout"):
        gguf_kernels.repack_x8(blocks(int(GGMLQuantizationType.Q8_0), 8), 8, COLS)
    with pytest.raises(ValueError, match="rows of weights"):
        gguf_kernels.matmul_int8(torch.randn(1, COLS), x8, gguf_kernels.X8 + kind, 17)
    with pytest.raises(ValueError, match="out must be"):
        gguf_kernels.repack_x8(
            blocks(kind, 9), kind, COLS, out=torch.empty(1, 5, dtype=torch.uint8)
        )


def test_a_projection_in_integers_runs_its_k_quants_from_the_x8_layout() -> None:
    from triode.gpu.gguf_weight import GgufStack, GgufWeight
    from triode.gpu.quant_matmul import GgufRows

    q4, q8 = int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q8_0)
    parts = (GgufWeight(blocks(q4, 24), q4, COLS), GgufWeight(blocks(q8, 16), q8, COLS))
    rows = GgufRows(GgufStack(parts), integer=gguf_kernels.INT8_TYPES)
    assert rows.x8 is not None and rows.x8.numel() == 3 * gguf_kernels.row_bytes(256 + q4, COLS)
    x = torch.randn(5, COLS)
    want = torch.cat(
        [gguf_kernels.matmul_int8(x, p.data, p.kind, p.shape[0]) for p in parts], dim=1
    )
    assert torch.equal(rows(x), want)
    exact = GgufRows(GgufStack(parts))  # the exact mode reads the file's blocks
    assert exact.x8 is None and not torch.equal(exact(x), want)


def mapped_resident(path: Path) -> int:
    """This process's resident bytes of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_repacked_weights_file_pages_are_given_back_and_read_again(tmp_path: Path) -> None:
    page = mmap.PAGESIZE
    path = tmp_path / "weights.bin"
    content = np.random.default_rng(0).integers(0, 256, 8 * page, dtype=np.uint8)
    path.write_bytes(content.tobytes())
    stat = os.stat(path)
    mapped = gguf_file._mapped(path, stat.st_size, stat.st_mtime_ns)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    data = whole[page // 2 : 6 * page + 100]  # pages 1..5 whole inside
    assert int(data.sum()) == int(content[page // 2 : 6 * page + 100].sum())  # read: resident
    assert mapped_resident(path) >= 7 * page
    assert gguf_file.release_pages(data) == 5 * page
    assert mapped_resident(path) <= 3 * page  # the pages at its ends are a neighbour's too
    assert torch.equal(data, torch.from_numpy(content[page // 2 : 6 * page + 100]))
    assert gguf_file.release_pages(whole[page : page + 10]) == 0  # no whole page inside
    assert gguf_file.release_pages(torch.zeros(3 * page, dtype=torch.uint8)) == 0  # not mapped
    assert gguf_file.release_pages(whole.view(-1, 64)[:, :32]) == 0  # not contiguous
