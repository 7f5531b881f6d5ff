"""The README's embedding example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.slow


def test_readme_embedding_example_runs(model_dir: Path) -> None:
    section = README.read_text().split("## Embedding triode in a trio program", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S)
    assert example is not None
    done = subprocess.run(
        [sys.executable, "-c", example.group(1)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].endswith("] True")  # the last output is finished
    assert len(lines) > 1  # and it streamed: one line per step
