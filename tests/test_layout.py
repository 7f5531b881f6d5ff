"""The repository's shape: the direction of imports between its packages, no import cycles, no
oversized modules, every package in the wheel, string imports that resolve, and the edge's use
of only what `triode.actors` exports."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import triode.actors

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wire", "actors", "gpu", "edge", "fuzz")
MAX_MODULE_LINES = 500

# package -> what it must not import anywhere, and what it must not import at module level
FORBIDDEN = {
    "wire": {"triode.actors", "triode.gpu", "triode.edge"},
    "actors": {"triode.edge", "torch"},
    "gpu": {"triode.actors", "triode.edge"},
    "edge": {"triode.gpu"},
    "fuzz": {"triode.gpu"},
}
FORBIDDEN_AT_IMPORT = {"wire": {"torch"}}
# the one door from actors into gpu, and the fuzz harness whose target is in gpu/ (the KV
# server a peer instance reaches): each may import what its package otherwise must not
DOORS = {"actors/core/executor.py", "fuzz/harnesses/kv_server.py"}

# Modules named in strings: child-process targets (`module:function`), `-m` commands, the CLI's
# benchmark table, the fuzz entry. A rename that misses one of these fails only when that path
# runs, so every one is listed here and checked to resolve.
STRING_IMPORTS = {
    "triode.actors",
    "triode.actors.child",
    "triode.actors.core.main",
    "triode.actors.core.main:serve_engine_core",
    "triode.edge.api_servers:serve_api_server",
    "triode.edge.bench.ab",
    "triode.edge.bench.embed",
    "triode.edge.bench.frontend",
    "triode.edge.bench.gguf_models",
    "triode.edge.bench.lora",
    "triode.edge.bench.llamacpp",
    "triode.edge.bench.spec",
    "triode.edge.bench.fleet",
    "triode.edge.bench.moe",
    "triode.edge.bench.serve",
    "triode.edge.bench.structured",
    "triode.edge.bench.throughput",
    "triode.edge.bench.vllm",
    "triode.edge.bench.weights",
    "triode.edge.cli",
    "triode.edge.entry:main",
    "triode.fuzz.live",
    "triode.fuzz.run",
    "triode.gpu.bench.collectives",
    "triode.gpu.bench.hf_baseline",
    "triode.gpu.bench.kv_transfer",
    "triode.gpu.bench.moe",
    "triode.gpu.bench.moe_model",
    "triode.gpu.bench.step",
    "triode.gpu.bench.weight_push",
    "triode.gpu.lora.random_adapter",
    "triode.gpu.checks.device",
    "triode.gpu.checks.gguf",
    "triode.gpu.checks.model",
    "triode.gpu.worker",
    "triode.gpu.worker:serve_worker",
    "triode.wire.bench",
}
MODULE_STRING = re.compile(r"triode(\.\w+)+(:\w+)?")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every product module by its dotted name -> (path, is a package's `__init__`)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT / package).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            found[".".join(["triode", package, *parts[: -1 if is_package else None]])] = (
                path,
                is_package,
            )
    return found


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks that read it."""
    return ast.parse(path.read_text(), str(path))


def test_top_level_holds_exactly_the_project() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {p.split("/")[0] for p in tracked if not p.startswith(".")}
    required = {"pyproject.toml", "README.md", "Makefile", *PACKAGES, "tests"}
    assert required <= top <= required


def _imports(path: Path, *, module_level: bool = False) -> set[str]:
    tree = _tree(path)
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
        if path.relative_to(ROOT).as_posix() in DOORS:
            continue
        for name in _imports(path):
            if _matches(name, FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
        for name in _imports(path, module_level=True):
            if _matches(name, FORBIDDEN_AT_IMPORT.get(package, set())):
                bad.append(f"{path.relative_to(ROOT)} imports {name} at import time")
    assert not bad


def _matches(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_product_module_is_over_the_limit() -> None:
    long = {
        f"{path.relative_to(ROOT)}: {n} lines"
        for path, _ in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long


def _import_time_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when a module is imported: not those under `if TYPE_CHECKING:`,
    not those inside functions or classes' methods."""
    run = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                run += _import_time_statements(node.body)
            run += _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            run += _import_time_statements(node.body)
            for handler in node.handlers:
                run += _import_time_statements(handler.body)
        elif isinstance(node, ast.ClassDef):
            run += _import_time_statements(node.body)
        else:
            run.append(node)
    return run


def _import_graph() -> dict[str, set[str]]:
    """Module -> the product modules importing it runs at once (parent packages included: an
    import of `a.b.c` runs `a.b`'s `__init__` first)."""
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in MODULES.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in _import_time_statements(_tree(path).body):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets.add(module)
                targets.update(f"{module}.{a.name}" for a in node.names)
        edges = set()
        for target in targets:
            parts = target.split(".")
            for k in range(2, len(parts) + 1):
                module = ".".join(parts[:k])
                if module in MODULES and module != name and not name.startswith(module + "."):
                    edges.add(module)
        graph[name] = edges
    return graph


def _cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycle_at_import_time() -> None:
    """A module whose import comes back to itself half-initialised works or fails by the order
    its importers happen to run in. A cycle is broken with a `TYPE_CHECKING` import or an
    import inside the function that needs it (with a comment saying why)."""
    graph = _import_graph()
    cycles = {" -> ".join(c) for m in sorted(graph) if (c := _cycle_from(graph, m))}
    assert not cycles


def test_the_checker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_from(graph, "d") is None


def _unexplained_lazy_imports(path: Path) -> list[str]:
    """Imports inside functions without a reason: no comment in the three lines above, no word
    of imports in the function's docstring, no word of lazy imports in the module's."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    module_doc = (ast.get_docstring(tree) or "").lower()
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = (ast.get_docstring(function) or "").lower()
        for node in ast.walk(function):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            above = lines[max(0, node.lineno - 4) : node.lineno]
            said = "import" in doc or "lazi" in doc or "lazi" in module_doc or "lazy" in module_doc
            if any("#" in line for line in above) or said:
                continue
            found.append(f"{path}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_import_inside_a_function_says_why() -> None:
    """An import inside a function hides a dependency from the top of the module: it is there
    to break a cycle, or to spare an entry point a heavy module it rarely needs, and it says
    which."""
    assert not [line for path, _ in MODULES.values() for line in _unexplained_lazy_imports(path)]


def test_the_lazy_import_checker_finds_one(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    x = 1\n\n    import json\n    return json\n")
    assert len(_unexplained_lazy_imports(module)) == 1
    module.write_text("def f():\n    # a reason\n    import json\n    return json\n")
    assert not _unexplained_lazy_imports(module)


def test_every_package_is_in_the_wheel() -> None:
    """setuptools builds the wheel from pyproject's explicit `packages` list: a folder missing
    from it installs without its modules, and only a fresh install would show it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {name for name, (_, is_package) in MODULES.items() if is_package}
    assert listed == on_disk
    for package, directory in config["package-dir"].items():
        assert directory == package.removeprefix("triode.")
    for package, patterns in config["package-data"].items():
        folder = ROOT / config["package-dir"][package]
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: nothing matches {pattern}"


def _string_imports() -> set[str]:
    found = set()
    for path, _ in MODULES.values():
        tree = _tree(path)
        loggers = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("getLogger")
            and node.args
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in loggers
                and MODULE_STRING.fullmatch(node.value)
            ):
                found.add(node.value)
    found.update(m.group(0) for m in MODULE_STRING.finditer((ROOT / "Makefile").read_text()))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found.update(project["scripts"].values())
    return found


def test_string_imports_are_the_known_ones_and_resolve() -> None:
    assert _string_imports() == STRING_IMPORTS
    for target in sorted(STRING_IMPORTS):
        module, _, function = target.partition(":")
        assert importlib.util.find_spec(module) is not None, target
        if function:
            assert callable(getattr(importlib.import_module(module), function)), target


def test_the_edge_takes_from_actors_only_what_it_exports() -> None:
    """`triode.actors`' exports (pinned in test_exports.py) are the edge's whole view of the
    engine: a deep import would let an internal rename break the edge unnoticed."""
    exported = set(vars(triode.actors))
    bad = []
    for path in sorted((ROOT / "edge").rglob("*.py")):
        for node in ast.walk(_tree(path)):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                bad += [
                    f"{where} {a.name}" for a in node.names if a.name.startswith("triode.actors.")
                ]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("triode.actors."):
                    bad.append(f"{where} {node.module}")
                elif node.module == "triode.actors":
                    bad += [f"{where} {a.name}" for a in node.names if a.name not in exported]
    assert not bad


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
