"""The standing file a restarted engine core reads: written whole or not at all, and a file that
is not one (too large, not JSON, unknown fields) leaves the engine to its flags."""

from __future__ import annotations

import os
from pathlib import Path

from triode.actors.core.standing import (
    MAX_STANDING_BYTES,
    Standing,
    StandingFile,
    StandingLoRA,
)


def test_a_standing_reads_back_as_written(tmp_path: Path) -> None:
    file = StandingFile(str(tmp_path / "standing.json"))
    assert file.read() is None  # a first start
    standing = Standing(
        weight_version=3,
        weights_path="/models/step-3",
        trainer_weights=True,
        loras=[StandingLoRA("a", "/adapters/a", "0" * 64), StandingLoRA("b", "/b", "1" * 64, "m")],
    )
    file.write(standing)
    assert file.read() == standing
    file.write(Standing())
    assert file.read() == Standing()
    assert os.listdir(tmp_path) == ["standing.json"]  # no partial file left beside it


def test_a_file_that_is_not_a_standing_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "standing.json"
    file = StandingFile(str(path))
    for content in (
        b"not json",
        b'{"weight_version": "three"}',
        b'{"weight_version": 1, "commands": ["rm -rf /"]}',
        b"{" + b" " * MAX_STANDING_BYTES + b"}",  # valid JSON, but past the bound
    ):
        path.write_bytes(content)
        assert file.read() is None
