"""`triode serve`'s LoRA checks at start: an adapter of `--lora-modules` named like a served model
is refused in one line before any process starts, and a server that would refuse runtime loads
of new paths says so once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from triode.edge.asyncio_app import create_app
from triode.edge.cli import main
from triode.edge.lora_names import lora_modules_problem
from triode.edge.settings import Settings


@pytest.mark.parametrize(
    "specs",
    [
        [],
        ["sql=/adapters/sql"],
        ["sql=/a", '{"name": "poem", "path": "/p", "base_model_name": "m"}'],
    ],
)
def test_adapters_named_apart_from_the_served_models_serve(specs: list[str]) -> None:
    assert lora_modules_problem(specs, ["base", "alias"]) is None


@pytest.mark.parametrize(
    ("specs", "problem"),
    [
        (["sql=/a", "alias=/b"], "--lora-modules: 'alias' is also a served model name"),
        (['{"name": "base", "path": "/b"}'], "--lora-modules: 'base' is also a served model name"),
        (["sql"], "lora_modules: 'sql' has no '='"),
        (["{not json"], "lora_modules: '{not json' is not valid JSON"),
    ],
)
def test_a_clash_or_an_unreadable_entry_is_named(specs: list[str], problem: str) -> None:
    found = lora_modules_problem(specs, ["base", "alias"])
    assert found is not None and found.startswith(problem)


def test_the_asyncio_app_refuses_a_clash_before_starting() -> None:
    modules = [{"name": "sql", "path": "/adapters/sql"}]  # a dict, as Python callers give it
    settings = Settings(served_model_names=["sql"])
    with pytest.raises(ValueError, match="'sql' is also a served model name"):
        create_app("tiny-random", settings=settings, enable_lora=True, lora_modules=modules)
    create_app("tiny-random", enable_lora=True, lora_modules=modules)  # nothing starts yet


def test_serve_refuses_a_clash_in_one_line_before_starting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_run(*args: Any) -> None:
        raise AssertionError("served despite the clash")

    monkeypatch.setattr(trio, "run", no_run)
    status = main(["serve", "--served-model-name", "sql", "--enable-lora",
                   "--lora-modules", "sql=/adapters/sql"])  # fmt: skip
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'sql' is also a served model name" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--enable-admin-api", "--enable-lora"], True),
        (["--enable-admin-api", "--enable-lora", "--allowed-lora-paths", "/adapters"], False),
        (["--enable-lora"], False),  # no runtime loads at all
        (["--enable-admin-api"], False),  # no LoRA
    ],
)
def test_serve_says_once_that_runtime_loads_of_new_paths_are_refused(
    argv: list[str], said: bool, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setattr(trio, "run", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="triode.serve"):
        assert main(["serve", "--api-key", "k", *argv]) == 0
    lines = [r.getMessage() for r in caplog.records if "--allowed-lora-paths" in r.getMessage()]
    assert len(lines) == int(said)
