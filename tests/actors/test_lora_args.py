"""The LoRA engine arguments: vLLM's flags on `triode serve`'s parser (lists take several values
and add up), their checks, and the two spellings of `--lora-modules`."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from triode.actors import EngineArgs, LoRAModule, parse_lora_module
from triode.edge.commands.engine_flags import add_engine_flags, given_engine_args


def _parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_flags({"engine": parser, "parallelism": parser, "options": parser})
    return EngineArgs(**given_engine_args(parser.parse_args(list(argv))))


def test_lora_flags_take_lists_and_both_module_spellings() -> None:
    args = _parse(
        "--enable-lora",
        "--lora-modules",
        "a=/p",
        "b=/q",
        "--lora-modules",
        '{"name": "c", "path": "/r", "base_model_name": "m"}',
        "--allowed-lora-paths",
        "/adapters",
        "/more",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--max-lora-rank",
        "64",
        "--lora-dtype",
        "bfloat16",
    )
    assert args.lora_module_list() == [
        LoRAModule("a", "/p"),
        LoRAModule("b", "/q"),
        LoRAModule("c", "/r", "m"),
    ]
    assert args.allowed_lora_paths == ["/adapters", "/more"]
    assert (args.max_loras, args.max_cpu_loras, args.max_lora_rank) == (2, 4, 64)
    # the struct crosses to the engine core and back unchanged
    assert msgspec.convert(msgspec.to_builtins(args), EngineArgs) == args
    assert _parse().enable_lora is False


def test_lora_modules_given_as_dicts_in_python_cross_as_json() -> None:
    args = EngineArgs(enable_lora=True, lora_modules=[{"name": "z", "path": "/z"}])  # type: ignore[list-item]
    assert msgspec.convert(msgspec.to_builtins(args), EngineArgs).lora_module_list() == [
        LoRAModule("z", "/z")
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora_modules": ["a=/p"]}, "--lora-modules need --enable-lora"),
        ({"max_loras": 2, "max_cpu_loras": 4}, "--max-loras, --max-cpu-loras need --enable-lora"),
        ({"enable_lora": True, "max_lora_rank": 5}, "max_lora_rank must be one of 1, 8, 16"),
        ({"enable_lora": True, "max_loras": 3, "max_cpu_loras": 2}, "must be >= max_loras"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras must be >= 1"),
        ({"enable_lora": True, "lora_modules": ["a=/p", "a=/q"]}, "'a' given more than once"),
        ({"enable_lora": True, "lora_modules": ["a b=/p"]}, "no whitespace"),
        ({"enable_lora": True, "lora_modules": ["/just/a/path"]}, "has no '='"),
        ({"enable_lora": True, "lora_dtype": "int8"}, "lora_dtype must be"),
    ],
)
def test_lora_args_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**fields)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("=/p", "needs a name and a path"),
        ("a=", "needs a name and a path"),
        ('{"name": "a"}', "Object missing required field `path`"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown field `rank`"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_lora_module_spellings_refused_with_both_forms_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        parse_lora_module(text)
    assert "name=path" in str(refused.value) and '"base_model_name"' in str(refused.value)
