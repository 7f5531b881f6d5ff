"""`triode serve` with a model whose generation_config.json recommends request defaults: the
engine core reads it (and `--override-generation-config` over it), says so at start-up, and a
request that leaves a field unset gets the default while one that gives it keeps its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
from integration.server import running_server

from triode.gpu.loader import tiny_random


def test_a_chat_without_max_tokens_gets_the_models_default_and_one_with_keeps_it(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_random(), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update({"max_new_tokens": 3, "temperature": 0.5})
    (model / "generation_config.json").write_text(json.dumps(config))
    override = '{"max_new_tokens": 4}'
    args = [str(model), "--override-generation-config", override, "--max-model-len", "128"]
    with running_server(args, tmp_path / "log", {"TRIODE_LOG_LEVEL": "INFO"}) as server:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}

        def tokens(**fields: object) -> int:
            answer = httpx.post(
                f"{server.url}/v1/chat/completions", json={**chat, **fields}, timeout=60
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["finish_reason"] == "length"
            return int(answer.json()["usage"]["completion_tokens"])

        assert tokens() == 4  # the override's, laid over the file's 3
        assert tokens(max_tokens=6) == 6
        log = server.output()
    assert "request defaults (where a request leaves them unset): temperature 0.5, " in log
    assert "max_tokens 4 (from --generation-config auto and --override-generation-config" in log
