"""The repository's shape and the direction of imports between its packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wire", "actors", "gpu", "edge", "fuzz")

# package -> what it must not import anywhere, and what it must not import at module level
FORBIDDEN = {
    "wire": {"triode.actors", "triode.gpu", "triode.edge"},
    "actors": {"triode.edge", "torch"},
    "gpu": {"triode.actors", "triode.edge"},
    "edge": {"triode.gpu"},
    "fuzz": {"triode.gpu"},
}
FORBIDDEN_AT_IMPORT = {"wire": {"torch"}}
# the fuzz harnesses whose target is in gpu/ (the KV server a peer instance reaches)
GPU_TARGETS = {"kv_server.py"}


def test_top_level_holds_exactly_the_project() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {p.split("/")[0] for p in tracked if not p.startswith(".")}
    required = {"pyproject.toml", "README.md", "Makefile", *PACKAGES, "tests"}
    assert required <= top <= required


def _imports(path: Path, *, module_level: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_edge_actors_wire(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if package == "actors" and path.name == "executor.py":
            continue  # the one door from actors into gpu
        if path.relative_to(ROOT).parts[:2] == ("fuzz", "harnesses") and path.name in GPU_TARGETS:
            continue  # a harness drives its target where it lives
        for name in _imports(path):
            if _matches(name, FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
        for name in _imports(path, module_level=True):
            if _matches(name, FORBIDDEN_AT_IMPORT.get(package, set())):
                bad.append(f"{path.relative_to(ROOT)} imports {name} at import time")
    assert not bad


def _matches(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_wire_and_actors_import_without_torch() -> None:
    code = "import sys, triode.wire, triode.actors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_serve_lists_its_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "triode.edge.cli", "serve", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    for flag in ("--api-key", "--served-model-name", "--root-path", "--allowed-origins",
                 "--max-model-len", "--kv-cache-memory", "--dtype", "--log-level"):  # fmt: skip
        assert flag in done.stdout
