"""`EngineArgs`' fields as `triode serve`'s engine options, built from the struct itself.

Each field is a flag spelled after it (`max_num_seqs`: `--max-num-seqs`), typed by its
annotation and described by its `EngineFlag`, so a new field is a new flag with no second edit.
A flag's default is None, "not given": only the flags given reach `EngineArgs`, whose own
defaults stand for the others.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec

from triode.actors import EngineArgs, EngineFlag, parse_size

_FIELDS = msgspec.structs.fields(EngineArgs)


def _flag(field: msgspec.structs.FieldInfo) -> EngineFlag:
    """The field's `EngineFlag`: the one in its `Annotated` type, else a plain engine flag."""
    flags = [m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, EngineFlag)]
    return flags[0] if flags else EngineFlag()


FLAG_FIELDS = [field.name for field in _FIELDS if _flag(field).group is not None]


def _value_options(name: str, annotation: Any) -> dict[str, Any]:
    """How argparse reads the field's value: a bool is --x/--no-x; a field that takes text
    (a size, JSON) gets it as given, for the struct to parse; an int or float is converted; a
    list takes one or more values, and a flag given again adds to them
    (`--lora-modules a=/p b=/q`)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is list:
        return {
            "nargs": "+",
            "action": "extend",
            **_value_options(name, *typing.get_args(annotation)),
        }
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = set(typing.get_args(annotation)) - {type(None)}
    else:
        members = {annotation}
    if members == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if str in members:
        return {}
    if members in ({int}, {float}):
        return {"type": members.pop()}
    raise TypeError(f"EngineArgs.{name}: no command-line spelling for {annotation}")


def add_engine_flags(groups: dict[str, Any]) -> None:
    """Add every flag to its group: `groups` maps an `EngineFlag.group` ("engine",
    "parallelism", "options") to the parser or argument group that lists it."""
    for field in _FIELDS:
        flag = _flag(field)
        if flag.group is None:
            continue
        names = [f"--{field.name.replace('_', '-')}", *([flag.short] if flag.short else [])]
        extra = {"help": flag.help, "metavar": flag.metavar, "choices": flag.choices}
        groups[flag.group].add_argument(
            *names,
            dest=field.name,
            default=None,
            **_value_options(field.name, field.type),
            **{k: v for k, v in extra.items() if v is not None},
        )


def given_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, as `EngineArgs` keyword arguments."""
    return {name: value for name in FLAG_FIELDS if (value := getattr(args, name)) is not None}


def kv_cache_check_flags(engine_args: dict[str, Any]) -> list[str]:
    """The flags of the model check (`python -m triode.gpu.checks.model`) that have it refuse a
    `--kv-cache-memory` that can never hold `--max-model-len`, before a GGUF file's conversion:
    the size in bytes, the length and what shapes a rank's cache. Empty unless both are given:
    with "auto", or the model's own context, the engine fits the context to the cache."""
    try:
        memory = parse_size(engine_args["kv_cache_memory"])
    except (KeyError, ValueError):  # not given, "auto", or not a size (`EngineArgs` says so)
        return []
    if not memory or engine_args.get("max_model_len") is None:
        return []
    flags = ["--kv-cache-memory", str(memory)]
    for name in ("max_model_len", "dtype", "tensor_parallel_size", "pipeline_parallel_size"):
        if engine_args.get(name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(engine_args[name])]
    return flags
