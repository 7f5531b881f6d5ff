"""Fixtures shared by the gpu tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model's converted directory; the test skips when it was never fetched."""
    from triode.gpu.loader import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
