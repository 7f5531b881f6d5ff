"""Fixtures shared by the gpu tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from triode.gpu import cpu_kernels


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The default model's converted directory; the test skips when it was never fetched."""
    from triode.gpu.loader import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Projections picked as on a CPU without AMX, where bfloat16 4-bit weights take
    `quant_matmul.c`'s kernels (which the decode stack runs); with AMX they take torch's and
    AMX's (`Int4Linear`, `test_int4.py`), which the stack leaves to the modules."""
    monkeypatch.setattr(cpu_kernels, "int4_amx_matmul", lambda: None)
