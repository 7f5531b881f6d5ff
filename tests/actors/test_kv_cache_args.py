"""`kv_cache_memory`: "auto" by default (kept as 0 across the process boundary), a size as before
when one is given; and the flags `triode serve` hands the model check only when a size and a
`--max-model-len` are both given."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import pytest

from triode.actors import EngineArgs
from triode.edge.commands.engine_flags import (
    add_engine_flags,
    given_engine_args,
    kv_cache_check_flags,
)


def _given(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_engine_flags({"engine": parser, "parallelism": parser, "options": parser})
    return given_engine_args(parser.parse_args(list(argv)))


def test_the_cache_is_auto_unless_a_size_is_given() -> None:
    assert EngineArgs().kv_cache_memory == 0
    assert EngineArgs(kv_cache_memory="auto").kv_cache_memory == 0
    assert EngineArgs(**_given("--kv-cache-memory", "512MiB")).kv_cache_memory == 512 << 20
    assert EngineArgs(kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20


def test_auto_crosses_to_the_engine_core_as_it_was_given() -> None:
    for args in (EngineArgs(), EngineArgs(kv_cache_memory="2GiB")):
        again = msgspec.convert(msgspec.to_builtins(args), EngineArgs)
        assert again.kv_cache_memory == args.kv_cache_memory


def test_what_is_neither_auto_nor_a_size_is_refused() -> None:
    with pytest.raises(ValueError, match="not a size: 'lots'"):
        EngineArgs(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory must be auto or a size"):
        EngineArgs(kv_cache_memory=-1)


def test_the_model_check_gets_the_cache_only_with_a_length_beside_it() -> None:
    assert kv_cache_check_flags(_given()) == []
    assert kv_cache_check_flags(_given("--kv-cache-memory", "1GiB")) == []
    assert kv_cache_check_flags(_given("--max-model-len", "4096")) == []
    auto = _given("--kv-cache-memory", "auto", "--max-model-len", "4096")
    assert kv_cache_check_flags(auto) == []
    assert kv_cache_check_flags(_given("--kv-cache-memory", "x", "--max-model-len", "9")) == []
    given = _given("--kv-cache-memory", "1GiB", "--max-model-len", "4096", "-tp", "2")
    assert kv_cache_check_flags(given) == [
        "--kv-cache-memory", str(1 << 30), "--max-model-len", "4096",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    given = _given("--kv-cache-memory", "1GiB", "--max-model-len", "9", "--dtype", "float32")
    assert kv_cache_check_flags(given)[-2:] == ["--dtype", "float32"]
