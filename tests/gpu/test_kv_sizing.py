"""`kv_sizing`: what "auto" gives the KV cache from the machine's memory figures, its bounds,
the context a cache of some size serves (lowered for the model's own, refused for one asked
for), and the figures read from /proc/meminfo and a cgroup v2 group."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triode.gpu import kv_sizing
from triode.gpu.kv_sizing import (
    AUTO_MAX,
    AUTO_MIN,
    GiB,
    KVGeometry,
    KVLimits,
    MiB,
    auto_kv_memory,
    cgroup_headroom,
    cpu_available_memory,
    fitted_max_model_len,
    meminfo_available,
    never_fits,
    size_kv_cache,
)

# Gemma 3 270M in bfloat16: 18 layers, one KV head of 256 values; 294912 bytes a block
GEMMA_270M = KVGeometry(layers=18, kv_heads=1, head_dim=256, itemsize=2, block_size=16)
# SmolLM2-135M in bfloat16: 30 layers, 3 KV heads of 64 values
SMOLLM2 = KVGeometry(layers=30, kv_heads=3, head_dim=64, itemsize=2, block_size=16)
UNBOUNDED = 1 << 62


class World:
    """A parallel world of one, as `ModelRunner` hands `size_kv_cache` its own."""

    rank, world_size = 0, 1


def test_a_block_holds_keys_and_values_of_every_layer() -> None:
    assert GEMMA_270M.block_bytes == 2 * 18 * 16 * 256 * 2 == 294912
    assert SMOLLM2.block_bytes == 2 * 30 * 16 * 3 * 64 * 2
    assert GEMMA_270M.bytes_for(32768) == 2048 * 294912 == 576 * MiB
    assert GEMMA_270M.bytes_for(17) == 2 * 294912  # whole blocks


@pytest.mark.parametrize(
    ("available", "share", "needed", "chosen"),
    [
        (16 * GiB, 0.25, UNBOUNDED, 4 * GiB),  # a quarter
        (512 * MiB, 0.25, UNBOUNDED, AUTO_MIN),  # never below the floor
        (256 * GiB, 0.25, UNBOUNDED, AUTO_MAX),  # nor above the ceiling
        (80 * GiB, 0.8, UNBOUNDED, AUTO_MAX),  # a GPU's share, bounded likewise
        (5 * GiB, 0.8, UNBOUNDED, 4 * GiB),
        (16 * GiB, 0.125, UNBOUNDED, 2 * GiB),  # a world of two ranks shares a CPU's quarter
        (16 * GiB, 0.25, 100 * MiB, 100 * MiB),  # what every sequence needs, below the floor
        (16 * GiB, 0.25, 3 * GiB, 3 * GiB),
    ],
)
def test_auto_takes_a_bounded_share_and_no_more_than_every_sequence_needs(
    available: int, share: float, needed: int, chosen: int
) -> None:
    assert auto_kv_memory(available, share, needed) == chosen


def test_the_models_context_is_lowered_to_the_whole_blocks_the_cache_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocks = 512 * MiB // GEMMA_270M.block_bytes
    with caplog.at_level(logging.WARNING, logger=kv_sizing.__name__):
        length = fitted_max_model_len(GEMMA_270M, blocks, 512 * MiB, 32768, given=False)
    assert (blocks, length) == (1820, 29120)
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "the model's context of 32768 tokens does not fit the 512MiB KV cache: serving "
        "max_model_len 29120, what it holds; for the whole context give --kv-cache-memory "
        "576MiB or more, or choose a length with --max-model-len"
    )


def test_a_context_that_fits_is_kept_and_nothing_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=kv_sizing.__name__):
        assert fitted_max_model_len(GEMMA_270M, 2048, 576 * MiB, 32768, given=True) == 32768
        assert fitted_max_model_len(SMOLLM2, 10, 10 * MiB, 100, given=False) == 100
    assert not caplog.records


def test_a_max_model_len_asked_for_that_does_not_fit_is_refused_as_before() -> None:
    with pytest.raises(ValueError) as refused:
        fitted_max_model_len(GEMMA_270M, 1820, 536870912, 32768, given=True)
    assert str(refused.value) == (
        "kv_cache_memory of 536870912 bytes holds 29120 tokens, less than max_model_len 32768: "
        "give it at least 603979776 bytes or lower max_model_len"
    )
    assert never_fits(536870912, 32768, GEMMA_270M) == str(refused.value)
    assert never_fits(576 * MiB, 32768, GEMMA_270M) is None


def test_a_cache_of_less_than_two_tokens_is_refused_even_for_the_models_context() -> None:
    with pytest.raises(ValueError, match="holds 0 tokens, less than max_model_len 8192"):
        fitted_max_model_len(SMOLLM2, 0, 1000, 8192, given=False)


def test_an_explicit_size_is_taken_as_it_is_and_the_world_takes_its_fewest_blocks() -> None:
    limits = KVLimits(memory=64 * MiB, max_model_len=8192, given=False, max_num_seqs=256)
    blocks, length = size_kv_cache(SMOLLM2, limits, None, World(), lambda value: value)
    assert blocks == 64 * MiB // SMOLLM2.block_bytes and length == blocks * 16
    # another rank holds fewer: every rank takes that count, and the length follows it
    blocks, length = size_kv_cache(SMOLLM2, limits, None, World(), lambda value: min(value, 100))
    assert (blocks, length) == (100, 1600)


def test_auto_on_this_cpu_is_within_its_bounds_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = KVLimits(memory=0, max_model_len=8192, given=False, max_num_seqs=256)
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        blocks, length = size_kv_cache(
            SMOLLM2, limits, torch.device("cpu"), World(), lambda value: value
        )
    chosen = blocks * SMOLLM2.block_bytes
    assert AUTO_MIN - SMOLLM2.block_bytes < chosen <= AUTO_MAX and length == 8192
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("KV cache: ") and "auto: 25% of the " in line
    assert line.endswith(
        "available after the weights, within 256MiB to 8GiB (--kv-cache-memory sets it)"
    )


def test_auto_takes_no_more_than_every_sequence_at_full_length_needs() -> None:
    limits = KVLimits(memory=0, max_model_len=100, given=False, max_num_seqs=2)
    blocks, length = size_kv_cache(
        SMOLLM2, limits, torch.device("cpu"), World(), lambda value: value
    )
    assert (blocks, length) == (2 * 7, 100)  # 7 blocks of 16 hold 100 tokens, for each of 2


MEMINFO = """MemTotal:       24684000 kB
MemFree:        20000000 kB
MemAvailable:   16777216 kB
Buffers:           10000 kB
"""


def test_meminfo_says_what_is_available() -> None:
    assert meminfo_available(MEMINFO) == 16 * GiB
    with pytest.raises(ValueError, match="no MemAvailable"):
        meminfo_available("MemTotal: 1 kB\n")


def _cgroup(tmp_path: Path, limit: str, current: int, line: str = "0::/job") -> Path:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(f"{limit}\n")
    (tmp_path / "job" / "memory.current").write_text(f"{current}\n")
    (tmp_path / "cgroup").write_text(f"{line}\n")
    (tmp_path / "meminfo").write_text(MEMINFO)
    return tmp_path


def test_a_cgroup_v2_limit_bounds_what_is_available(tmp_path: Path) -> None:
    root = _cgroup(tmp_path, str(6 * GiB), 2 * GiB)
    assert cgroup_headroom(root / "cgroup", root) == 4 * GiB
    assert cpu_available_memory(root / "meminfo", root / "cgroup", root) == 4 * GiB


def test_a_cgroup_without_a_limit_leaves_meminfos_figure(tmp_path: Path) -> None:
    root = _cgroup(tmp_path, "max", 2 * GiB)
    assert cgroup_headroom(root / "cgroup", root) is None
    assert cpu_available_memory(root / "meminfo", root / "cgroup", root) == 16 * GiB


def test_a_limit_above_meminfos_figure_or_no_cgroup_v2_leaves_meminfos(tmp_path: Path) -> None:
    root = _cgroup(tmp_path, str(64 * GiB), GiB)
    assert cpu_available_memory(root / "meminfo", root / "cgroup", root) == 16 * GiB
    (root / "cgroup").write_text("4:memory:/job\n")  # cgroup v1 only
    assert cgroup_headroom(root / "cgroup", root) is None
    assert cgroup_headroom(root / "nowhere", root) is None


def test_the_module_imports_without_torch() -> None:
    code = "import sys, triode.gpu.kv_sizing; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
