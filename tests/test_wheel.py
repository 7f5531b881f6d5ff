"""A wheel built from the tree installs and runs: every package and kernel source is in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

IGNORED = (".*", "build", "*.egg-info", "__pycache__", "tests", "crashes")


def test_a_wheel_from_the_tree_installs_and_runs(tmp_path: Path) -> None:
    # built from a copy: setuptools' build/ folder keeps modules the tree no longer has
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*IGNORED))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    [wheel] = (tmp_path / "dist").glob("triode-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True
    )
    # the dependencies come from this environment's site-packages, added after the fresh
    # venv's own (a plain path line in a .pth: this environment's editable install of the
    # tree, a .pth of its own there, is not read)
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    def run(*args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = run(
        str(python), "-c",
        "import triode.edge, triode.gpu.cpu_kernels as k; print(triode.edge.__file__); "
        "print(all(p.is_file() for p in k.SOURCES + k.HEADERS))",
    )  # fmt: skip
    assert where.split() == [str(site / "triode" / "edge" / "__init__.py"), "True"]
    assert "--max-model-len" in run(str(venv / "bin" / "triode"), "serve", "--help")
    assert "kv-transfer" in run(str(venv / "bin" / "triode"), "bench", "--help")
    assert "usage" in run(str(python), "-m", "triode.fuzz.live", "--help")
