"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server import running_server

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


def test_readme_asyncio_example_runs(model_dir: Path) -> None:
    section = README.read_text().split("## Embedding triode in an asyncio program", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S)
    assert example is not None and "asyncio.run(main())" in example.group(1)
    done = subprocess.run(
        [sys.executable, "-c", example.group(1)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    # a print per step, of the text so far: the answer first, then the rest of the reply
    assert "Paris" in lines[0] and len(lines) > 1


def test_readme_serving_example_runs(model_dir: Path, tmp_path: Path) -> None:
    section = README.read_text().split("## Serving the OpenAI API", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S)
    assert example is not None
    with running_server(["--api-key", "KEY"], tmp_path / "serve.log") as server:
        code = example.group(1).replace("http://127.0.0.1:8000", server.url)
        code += "\nprint(reply.choices[0].message.content)\n"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
