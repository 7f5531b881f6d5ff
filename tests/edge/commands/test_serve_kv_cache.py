"""`triode serve` with a KV cache smaller than the model's context: it serves the context the
cache holds (said in one warning, published as /v1/models' max_model_len and enforced on
requests); a `--max-model-len` given with a cache that can never hold it is one line and exit
status 2 before any process starts, and for a GGUF file before its conversion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import pytest
from integration.server import running_server

from triode.gpu.loader import tiny_random
from triode.wire.ports import free_port

# tiny-random in float32: 8 KiB a block of 16 tokens, its own context 2048 tokens
SMALL_CACHE = ["--dtype", "float32", "--kv-cache-memory", "256KiB"]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_random()


def _ids(count: int) -> list[int]:
    """A prompt of `count` token ids, all in the smallest vocabulary tiny-random may have."""
    return [3 + i % 250 for i in range(count)]


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`triode serve ARGS` to its end (a model that served would be a timeout here)."""
    command = [sys.executable, "-m", "triode.edge.cli", "serve", *args, "--log-level", "warning"]
    command += ["--port", str(free_port())]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_the_server_serves_the_context_its_cache_holds_and_says_so(
    tiny: Path, tmp_path: Path
) -> None:
    with running_server([str(tiny), *SMALL_CACHE], tmp_path / "log") as server:
        [card] = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        fits = {"prompt": _ids(500), "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=fits, timeout=60)
        too_long = {"prompt": _ids(520), "max_tokens": 4}
        refused = httpx.post(f"{server.url}/v1/completions", json=too_long, timeout=60)
        log = server.output()
    assert card["max_model_len"] == 512
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert refused.status_code == 400
    assert "maximum context length is 512 tokens" in refused.json()["error"]["message"]
    warnings = [line for line in log.splitlines() if "does not fit the 256KiB KV cache" in line]
    assert len(warnings) == 1 and "serving max_model_len 512" in warnings[0]
    assert "--kv-cache-memory 1MiB or more" in warnings[0]


def test_a_max_model_len_the_cache_can_never_hold_is_one_line_before_the_engine_starts(
    tiny: Path,
) -> None:
    done = _serve(str(tiny), *SMALL_CACHE, "--max-model-len", "1000")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "triode serve: kv_cache_memory of 262144 bytes holds 512 tokens, less than "
        "max_model_len 1000: give it at least 516096 bytes or lower max_model_len"
    ]


def test_a_gguf_file_is_refused_before_it_is_converted(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")  # Gemma 3 270M's sizes
    writer.add_context_length(32768)
    writer.add_block_count(18)
    writer.add_embedding_length(640)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    flags = ["--kv-cache-memory", "512MiB", "--max-model-len", "32768"]
    done = _serve(str(tmp_path / "m.gguf"), *flags, env={"TRIODE_CACHE": str(cache)})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "triode serve: kv_cache_memory of 536870912 bytes holds 29120 tokens, less than "
        "max_model_len 32768: give it at least 603979776 bytes or lower max_model_len"
    ]
    assert not (cache / "converted").exists()
