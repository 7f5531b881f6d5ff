"""A GGUF file's manifest (`gguf_file`): what it reads is checked against the mapped file, so a
changed file or a manifest pointing past the file's end is refused before any weight is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from triode.gpu.gguf_file import MANIFEST, packed_weights


def _copy(smollm2: Path, tmp_path: Path) -> Path:
    out = tmp_path / "converted"
    shutil.copytree(smollm2, out)
    return out


def test_a_manifest_reaching_past_the_files_end_is_refused(smollm2: Path, tmp_path: Path) -> None:
    converted = _copy(smollm2, tmp_path)
    manifest = json.loads((converted / MANIFEST).read_text())
    assert len(dict(packed_weights(converted))) == len(manifest["tensors"])
    last = manifest["tensors"][-1]
    last["offset"] = manifest["size"] - 1  # one byte from the end: its rows cannot fit
    (converted / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OSError, match="past the end"):
        dict(packed_weights(converted))
    last["offset"] = -1
    (converted / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OSError, match="past the end"):
        dict(packed_weights(converted))


def test_a_file_changed_since_its_conversion_is_refused(smollm2: Path, tmp_path: Path) -> None:
    converted = _copy(smollm2, tmp_path)
    manifest = json.loads((converted / MANIFEST).read_text())
    gguf = tmp_path / "copy.gguf"
    shutil.copyfile(manifest["file"], gguf)
    stat = gguf.stat()
    manifest |= {"file": str(gguf), "mtime_ns": stat.st_mtime_ns}
    (converted / MANIFEST).write_text(json.dumps(manifest))
    assert len(dict(packed_weights(converted))) == len(manifest["tensors"])
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: another file now
    with pytest.raises(OSError, match="changed since it was converted"):
        dict(packed_weights(converted))


def test_a_manifest_of_another_layout_is_refused(smollm2: Path, tmp_path: Path) -> None:
    converted = _copy(smollm2, tmp_path)
    manifest = json.loads((converted / MANIFEST).read_text())
    manifest["version"] = 0
    (converted / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OSError, match="another layout"):
        dict(packed_weights(converted))
