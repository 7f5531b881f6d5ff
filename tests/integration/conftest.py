"""Fixtures for tests on the real default model: its converted directory and HF references."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from reference import Reference


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
