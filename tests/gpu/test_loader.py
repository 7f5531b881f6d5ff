"""Model resolution, GGUF conversion caching, tiny models (and the `tiny-random` name), and the
automatic dtype."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from triode.actors import SamplingParams, open_engine
from triode.gpu import dtypes, loader
from triode.gpu.cache_paths import DEFAULT_GGUF, TINY_RANDOM, converted_dir
from triode.gpu.dtypes import cpu_has_native_bf16, resolve_dtype
from triode.gpu.loader import resolve_model
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRIODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the 30-second dequantization with a stub that records its calls."""
    calls: list[Path] = []

    def write(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"from": str(gguf)}))

    monkeypatch.setattr(loader, "_write_hf_dir", write)
    return calls


def test_missing_default_model_says_to_run_make_model(cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make model"):
        resolve_model(None)


def test_a_model_directory_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_a_path_that_is_no_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config"):
        resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model(tmp_path / "nothing.gguf")


def test_gguf_converts_once_and_again_when_the_file_changes(
    cache: Path, tmp_path: Path, fake_conversion: list[Path]
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"v1")
    first = resolve_model(gguf)
    assert resolve_model(gguf) == first
    assert len(fake_conversion) == 1
    assert first.parent == cache / "converted" and first.name.startswith("m-")
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temp left
    os.utime(gguf, ns=(0, 10**9))
    assert resolve_model(gguf) != first
    assert len(fake_conversion) == 2


def test_losing_a_conversion_race_returns_the_winners_directory(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"v1")
    out = converted_dir(gguf)

    def slow_write(gguf: Path, tmp: Path) -> None:
        out.mkdir(parents=True)  # another process finished first
        (out / "config.json").write_text('{"winner": true}')
        (tmp / "config.json").write_text('{"winner": false}')

    monkeypatch.setattr(loader, "_write_hf_dir", slow_write)
    assert resolve_model(gguf) == out
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in out.parent.iterdir()] == [out.name]


@pytest.mark.slow
def test_default_model_resolves_fast_once_converted() -> None:
    gguf = loader.default_gguf()
    if not gguf.is_file():
        pytest.skip(f"{DEFAULT_GGUF} is not fetched; run `make model`")
    first = resolve_model(None)  # converts on the very first run (~30 s)
    written = _stamps(first)
    assert resolve_model(None) == first
    assert _stamps(first) == written  # found, not converted again
    names = {p.name for p in first.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads((first / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tiny_model_builds_with_a_byte_tokenizer_and_loads(cache: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "tiny", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == 259
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_memory=1 << 20, max_model_len=128)
    assert (runner.vocab_size, runner.eos_token_id, runner.max_model_len) == (259, 2, 128)
    assert runner.num_kv_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)


def test_tiny_random_is_built_once_into_the_cache(cache: Path) -> None:
    first = resolve_model(TINY_RANDOM)
    assert first == cache / "tiny-random" and first.is_dir()
    assert (first / "tokenizer.json").is_file() and list(first.glob("*.safetensors"))
    config = json.loads((first / "config.json").read_text())
    sizes = (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"])
    assert sizes == (64, 2, 2048)
    assert [p.name for p in cache.iterdir()] == ["tiny-random"]  # no temporary directory left
    written = _stamps(first)
    assert resolve_model(TINY_RANDOM) == first
    assert _stamps(first) == written  # found, not built again


@pytest.mark.slow
async def test_an_engine_on_tiny_random_generates(cache: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async with open_engine(TINY_RANDOM, max_num_seqs=4) as engine:
        assert engine.model_dir == cache / "tiny-random"
        outputs = [out async for out in engine.generate("Hello there", params)]
    assert outputs[-1].finished
    assert len(outputs[-1].outputs[0].token_ids) == 8


def test_dtype_auto_follows_the_cpus_bf16_support(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    native = "avx512_bf16" in flags or "amx_bf16" in flags or "bf16" in flags
    assert cpu_has_native_bf16() == native
    expected = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def _stamps(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Each file's (inode, modification time): a file written again changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model_dir.iterdir()}
