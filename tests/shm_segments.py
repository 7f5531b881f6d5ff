"""The shared-memory segments a test leaves behind: none (`no_segment_outlives_a_test`, used
as an autouse fixture by the modules that make segments)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from triode.wire.tensor_ipc import NAME_PREFIX

SHM = Path("/dev/shm")


def segments() -> set[str]:
    """The names of the shared tensors' segments that exist now."""
    return {p.name for p in SHM.glob(NAME_PREFIX + "*")}


@pytest.fixture(autouse=True)
def no_segment_outlives_a_test() -> Iterator[None]:
    before = segments()
    yield
    assert segments() <= before
