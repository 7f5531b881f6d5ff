"""Fixtures for tests on the real default model: its converted directory and HF references."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
from reference import Reference
from server import Server, running_server


@functools.cache
def _model_dir() -> Path:
    from triode.gpu.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    try:
        return _model_dir()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not fetched ({e}); run `make model`")


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


API_KEYS = ("test-key", "second-key")
SERVED_NAME = "smol"
ROOT_PATH = "/api"


@pytest.fixture(scope="module")
def server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    """One `triode serve` on the default model for a test module: two API keys (each its own
    tenant of the prefix cache), a root path, a served model name and a 1 MiB body limit, and
    the flags the module names in `SERVER_ARGS`."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    args = [
        "--api-key", *API_KEYS, "--root-path", ROOT_PATH, "--served-model-name", SERVED_NAME,
        "--max-num-seqs", "16", "--max-body-size", "1MiB", "--max-model-len", "2048",
        "--prefix-cache-isolation", "key", *getattr(request.module, "SERVER_ARGS", ()),
    ]  # fmt: skip
    with running_server(args, log) as s:
        yield s
