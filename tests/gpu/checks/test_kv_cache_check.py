"""The model check refuses a `--kv-cache-memory` that can never hold the `--max-model-len` given
with it, from the GGUF header or config.json alone (before a GGUF file is converted), in the
runner's words; "auto", the model's own context, or a cache that may fit pass."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from triode.gpu.checks.model import ModelProblem, check_model, gguf_kv_sizes, kv_sizes, main
from triode.gpu.kv_sizing import KVCacheAsked, KVSizes

# 2 layers x 2 KV heads x 16 values (64 / 4 heads) x keys and values x 2 bytes (the smallest
# dtype "auto" may be) x 16 tokens: 4 KiB a block
BLOCK = 4096


def _gguf(path: Path, architecture: str = "llama", **extra: int) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(4096)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}" for i in range(300)])  # an array to skip past
    if "key_length" in extra:
        writer.add_key_length(extra["key_length"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _model_dir(path: Path, architecture: str = "LlamaForCausalLM") -> Path:
    path.mkdir()
    config = {
        "architectures": [architecture],
        "max_position_embeddings": 4096,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_sizes_come_from_the_gguf_header_and_from_config_json(tmp_path: Path) -> None:
    assert gguf_kv_sizes(_gguf(tmp_path / "m.gguf")) == KVSizes(4096, 2, 2, 16)
    assert gguf_kv_sizes(_gguf(tmp_path / "k.gguf", key_length=32)) == KVSizes(4096, 2, 2, 32)
    assert kv_sizes(None, _model_dir(tmp_path / "d")) == KVSizes(4096, 2, 2, 16)
    assert kv_sizes(None, None) is None


def test_an_encoder_keeps_no_kv_cache_to_check(tmp_path: Path) -> None:
    assert kv_sizes(None, _model_dir(tmp_path / "bert", "BertModel")) is None


def test_a_cache_that_can_never_hold_the_length_asked_for_is_refused_before_conversion(
    tmp_path: Path,
) -> None:
    path = str(_gguf(tmp_path / "m.gguf"))
    with pytest.raises(ModelProblem) as refused:
        check_model(path, kv_cache=KVCacheAsked(64 * BLOCK, 4096))
    assert str(refused.value) == (
        "kv_cache_memory of 262144 bytes holds 1024 tokens, less than max_model_len 4096: give "
        f"it at least {256 * BLOCK} bytes or lower max_model_len"
    )
    check_model(path, kv_cache=KVCacheAsked(256 * BLOCK, 4096))
    check_model(path, kv_cache=KVCacheAsked(64 * BLOCK, 1024))


def test_the_length_is_capped_at_the_models_context_as_the_runner_caps_it(tmp_path: Path) -> None:
    check_model(str(_gguf(tmp_path / "m.gguf")), kv_cache=KVCacheAsked(256 * BLOCK, 100000))


def test_float32_and_a_parallel_world_change_what_a_rank_holds(tmp_path: Path) -> None:
    sizes = kv_sizes(None, _model_dir(tmp_path / "d"))
    asked = {"memory": 256 * BLOCK, "max_model_len": 4096}
    assert KVCacheAsked(**asked).problem(sizes) is None
    float32 = KVCacheAsked(**asked, dtype="float32").problem(sizes)
    assert float32 is not None and "holds 2048 tokens, less than max_model_len 4096" in float32
    # a rank holds one layer of two (pipeline) and one KV head of two (tensor parallel)
    assert KVCacheAsked(**asked, dtype="float32", pipeline_parallel_size=2).problem(sizes) is None
    assert KVCacheAsked(64 * BLOCK, 4096, "auto", 2, 2).problem(sizes) is None
    assert "holds 2048 tokens" in str(KVCacheAsked(64 * BLOCK, 4096, "auto", 2, 1).problem(sizes))
    assert KVCacheAsked(1, 4096).problem(None) is None  # sizes not known: the runner's to say


def test_a_model_whose_sizes_are_not_all_known_is_left_to_the_runner(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")  # no context length
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_model(str(tmp_path / "m.gguf"), kv_cache=KVCacheAsked(1, 4096))


def test_the_command_takes_the_cache_and_the_length_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(_gguf(tmp_path / "m.gguf"))
    assert main([path, "--kv-cache-memory", str(64 * BLOCK)]) == 0  # no length: fitted at start
    assert main([path, "--kv-cache-memory", str(64 * BLOCK), "--max-model-len", "4096"]) == 2
    assert capsys.readouterr().err.startswith("kv_cache_memory of 262144 bytes holds 1024 tokens")
    flags = ["--kv-cache-memory", str(64 * BLOCK), "--max-model-len", "4096", "-h"]
    with pytest.raises(SystemExit):
        main([path, *flags])
    assert "--tensor-parallel-size" in capsys.readouterr().out
