"""The model runner fits its context to its KV cache: a model's own context that the cache cannot
hold is served shorter (whole blocks, one warning) and generates as a roomier cache does; a
`max_model_len` asked for that does not fit is refused; "auto" takes no more than every sequence
needs; and an "auto" cache takes its memory as its blocks are written."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest
import torch
from runner_driver import Driver

from triode.gpu import kv_memory, kv_sizing
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model

KiB = 1 << 10
# the tiny model in float32: 2 layers x 2 KV heads x 16 values x keys and values x 4 bytes x 16
# tokens is 8 KiB a block; its own context is 1024 tokens, 512 KiB
BLOCK = 8 * KiB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fit") / "tiny", tokenizer_from="bytes")


def _runner(model_dir: Path, **kwargs: object) -> ModelRunner:
    options: dict = {"dtype": "float32", "num_threads": 1}  # one thread: see test_model_runner
    return ModelRunner(model_dir, **(options | kwargs))


def test_the_models_context_is_lowered_to_what_the_cache_holds_and_generates_alike(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=kv_sizing.__name__):
        small = _runner(tiny, kv_cache_memory=32 * BLOCK)
    assert (small.num_kv_blocks, small.max_model_len) == (32, 512)
    [line] = [r.getMessage() for r in caplog.records]
    assert (
        "context of 1024 tokens does not fit the 256KiB KV cache: serving max_model_len 512" in line
    )
    assert "--kv-cache-memory 512KiB or more" in line and "--max-model-len" in line
    # the rotary tables were built for 1024 positions before the lowering: the last positions
    # the lowered length allows come out as in a cache that holds the whole context
    roomy = _runner(tiny, kv_cache_memory=128 * BLOCK)
    assert roomy.max_model_len == 1024
    prompt = [(i * 37) % 250 + 3 for i in range(500)]
    outputs = []
    for runner in (small, roomy):
        driver = Driver(runner)
        driver.add("r", prompt)
        driver.run(12)  # to position 511, the lowered length's last
        outputs.append(driver.seqs["r"].output)
    assert outputs[0] == outputs[1]


def test_a_max_model_len_asked_for_that_the_cache_cannot_hold_is_refused(tiny: Path) -> None:
    with pytest.raises(ValueError) as refused:
        _runner(tiny, kv_cache_memory=32 * BLOCK, max_model_len=1000)
    assert str(refused.value) == (
        "kv_cache_memory of 262144 bytes holds 512 tokens, less than max_model_len 1000: give "
        f"it at least {63 * BLOCK} bytes or lower max_model_len"
    )
    assert _runner(tiny, kv_cache_memory=32 * BLOCK, max_model_len=500).max_model_len == 500
    with pytest.raises(ValueError, match="less than max_model_len 1024"):  # the model's own, asked
        _runner(tiny, kv_cache_memory=32 * BLOCK, max_model_len=1024)


def test_auto_takes_what_every_sequence_at_full_length_needs_and_says_so(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        runner = _runner(tiny, kv_cache_memory=kv_sizing.AUTO, max_num_seqs=4)
    assert (runner.num_kv_blocks, runner.max_model_len) == (4 * 64, 1024)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("KV cache: 2MiB per rank, auto: 25% of the ")
    assert "capped at what every sequence at full length needs (--kv-cache-memory sets it)" in line


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_an_auto_caches_memory_is_taken_as_its_blocks_are_written_and_given_back() -> None:
    shape = (2, 2, 4096, 16, 8, 64)  # 512 MiB of float32
    before = _resident()
    cache = kv_memory.zeroed(shape, torch.float32, torch.device("cpu"), lazy=True)
    assert cache.shape == shape and cache.is_contiguous()
    assert _resident() - before < 64 << 20  # nothing taken yet
    assert not cache[1, 1, 4095].any()  # reads see zeros
    cache[0, 0, :2048] = 1.0  # 64 MiB written
    assert 48 << 20 < _resident() - before < 128 << 20
    del cache
    gc.collect()
    assert _resident() - before < 64 << 20
