"""The app over a real engine with LoRA enabled (a tiny random model in the engine core, random
PEFT adapters): what `list_loras` answers reaches /v1/models, a request's `model` picks the
adapter the engine runs, and the admin routes load and unload through the engine core's
registry with its refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_harness import call

from triode.actors import open_engine
from triode.edge.app import App, open_app
from triode.edge.settings import Settings
from triode.gpu.lora.random_adapter import write_random_adapter

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 100, 3, 7, 8]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triode.gpu.tiny_model import build_tiny_model  # torch: only when this module runs

    root = tmp_path_factory.mktemp("lora-edge")
    tiny = build_tiny_model(root / "tiny", num_layers=2)
    for seed, name in enumerate(("a", "b")):
        write_random_adapter(tiny, root / "adapters" / name, rank=8, seed=seed, b_std=0.5)
    return root


async def _complete(app: App, model: str) -> Any:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return await call(app, "POST", "/v1/completions", body)


async def _load(app: App, name: str, path: Path) -> Any:
    body = {"lora_name": name, "lora_path": str(path)}
    return await call(app, "POST", "/v1/load_lora_adapter", body)


async def test_adapters_through_the_app_and_a_real_engine(root: Path) -> None:
    adapters = root / "adapters"
    engine_args = {
        "dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256,
        "enable_lora": True, "lora_modules": [f"a={adapters / 'a'}"], "max_loras": 2,
        "allowed_lora_paths": [str(adapters)],
    }  # fmt: skip
    settings = Settings(served_model_names=["tiny"], enable_admin_api=True)
    async with (
        open_engine(str(root / "tiny"), **engine_args) as engine,
        open_app(engine, settings) as app,
    ):
        cards = (await call(app, "GET", "/v1/models")).json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("tiny", None, str(root / "tiny")), ("a", "tiny", str(adapters / "a"))
        ]  # fmt: skip

        base, with_a = await _complete(app, "tiny"), await _complete(app, "a")
        assert base.status == with_a.status == 200, with_a.body
        assert (base.json()["model"], with_a.json()["model"]) == ("tiny", "a")
        base_ids = base.json()["choices"][0]["token_ids"]
        assert with_a.json()["choices"][0]["token_ids"] != base_ids  # the adapter ran

        assert (await _complete(app, "b")).status == 404
        loaded = await call(
            app,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "b", "lora_path": str(adapters / "b")},
        )
        assert loaded.status == 200, loaded.body
        assert loaded.json()["name"] == "b" and len(loaded.json()["digest"]) == 64
        with_b = await _complete(app, "b")
        assert with_b.status == 200 and with_b.json()["model"] == "b"
        assert with_b.json()["choices"][0]["token_ids"] not in (
            base_ids, with_a.json()["choices"][0]["token_ids"]
        )  # fmt: skip

        outside = await call(
            app,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "c", "lora_path": str(root / "tiny")},
        )
        assert (
            outside.status == 400 and "--allowed-lora-paths" in outside.json()["error"]["message"]
        )

        unloaded = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
        assert unloaded.status == 200, unloaded.body
        assert (await _complete(app, "b")).status == 404
        again = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
        assert again.status == 404 and again.json()["error"]["code"] == "not_found"
