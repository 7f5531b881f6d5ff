"""`triode bench structured`'s grammar-engine table, on the default model's vocabulary."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from triode.edge.bench import structured as bench_structured

TINY = (
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"ok": True},
)
FEW = ["--skip-serve", "--schemas", "tiny", "--compile-runs", "1", "--walks", "1", "--batch", "2"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from triode.gpu.loader import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not fetched ({e}); run `make model`")


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_structured.SCHEMAS, "tiny", TINY)


def _rows(out: str, label: str) -> list[str]:
    return [line.split() for line in out.splitlines() if line.strip().startswith(label)]


@pytest.mark.usefixtures("tiny")
def test_engine_table_goes_on_without_xgrammar(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    bench_structured.main(["--model", str(model_dir), *FEW])
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "llguidance" in header and header.split()[-1] == "xgrammar"
    assert re.search(r"^tiny schema .*, a walk of \d+ tokens$", out, re.MULTILINE)
    for label in ("compile, cold, median of 1 (ms)", "compile + first mask",
                  "mask per step, 1 seq", "mask per step, 2 seqs in parallel"):  # fmt: skip
        [row] = _rows(out, label)
        assert float(row[-2]) > 0 and row[-1] == "-"  # llguidance measured, xgrammar absent
    assert "(xgrammar: not installed:" in out
    assert "vocabulary 49152" in out


@pytest.mark.usefixtures("tiny")
def test_engine_table_sets_the_engines_side_by_side(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    bench_structured.main(["--model", str(model_dir), *FEW])
    out = capsys.readouterr().out
    [row] = _rows(out, "mask per step, 2 seqs in parallel")
    llg, xgr, ratio = float(row[-3]), float(row[-2]), row[-1]
    assert llg > 0 and xgr > 0 and ratio.endswith("x")
    assert "not installed" not in out
