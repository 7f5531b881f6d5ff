"""`python -m triode.gpu.checks.model [MODEL]`: will MODEL load? What can be known without torch.

`triode serve` runs this before it starts the engine core, so that a model that cannot run is
one line (`triode serve: <problem>`, exit status 2) in a fraction of a second instead of a
traceback from the engine core seconds later. MODEL is what `triode serve` takes: a Hugging Face
directory, a .gguf file, `tiny-random`, or nothing for the default model. It checks:

- the path exists and is a model: a directory with config.json, tokenizer.json and *.safetensors,
  or a .gguf file;
- the architecture is one this package runs: config.json's `architectures`, or a GGUF file's
  `general.architecture` (read from its header by hand: gguf's reader parses the whole file,
  6 s for the default model's), without converting it;
- config.json has the sizes the model is built from, and each checkpoint tensor this check
  knows the shape of (embeddings, attention and dense feed-forward projections, norms) has that
  shape, and each layer has tensors (from the safetensors headers: 8 bytes of length, then
  JSON);
- `--generation-config` and `--override-generation-config` give defaults
  (`generation_config.py`);
- a `--kv-cache-memory` given with a `--max-model-len` can hold that many tokens at all (the
  context length, layers, KV heads and head size from config.json or the GGUF header, before a
  GGUF file's conversion; at the dtype's smallest size, so only what never fits is refused).

A model that passes may still fail to load (a tensor this check has no shape for, a default
model never fetched); the engine core then reports that in one line as well. Exit status 0,
silent, when nothing is wrong.
"""

from __future__ import annotations

import argparse
import json
import mmap
import re
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cache_paths import TINY_RANDOM, default_gguf, tiny_random_dir
from ..generation_config import GenerationConfigError, request_defaults
from ..kv_sizing import ITEMSIZES, KVCacheAsked, KVSizes, config_kv_sizes
from ..models.architectures import UnsupportedArchitecture, supported_architecture
from ..pooling_spec import is_encoder

# what every family builds its model from
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# gguf's `general.architecture` names of the families this package runs (Mixtral's files are
# llama files with experts)
GGUF_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "qwen3moe", "gemma3"})
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class ModelProblem(Exception):
    """Why the model cannot be served, in one line."""


def check_model(
    model: str | None,
    generation_config: str = "auto",
    override: str | None = None,
    kv_cache: KVCacheAsked | None = None,
) -> None:
    """Raise `ModelProblem` if `model` (as `triode serve` takes it) cannot be served, or
    cannot serve `kv_cache`'s `max_model_len` in its memory."""
    gguf = None
    if model is None:
        # a missing one is the engine core's to report (one line too, naming `make model`),
        # so that the rest of a command line is checkable where the model was never fetched
        if default_gguf().is_file():
            gguf = default_gguf()
            check_gguf(gguf)
        model_dir = None
    elif model == TINY_RANDOM:
        # built by this package, on first use: a check of a directory it will write is moot
        model_dir = tiny_random_dir() if tiny_random_dir().is_dir() else None
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            check_model_dir(path)
            model_dir = path
        elif path.suffix == ".gguf" and path.is_file():
            check_gguf(path)
            gguf, model_dir = path, None  # converted on first use; its generation config then
        elif not path.exists():
            raise ModelProblem(f"{model}: no such file or directory")
        else:
            raise ModelProblem(f"{model}: not a model directory or a .gguf file")
    try:
        request_defaults(model_dir, generation_config, override)
    except GenerationConfigError as e:
        raise ModelProblem(str(e)) from None
    if kv_cache is not None:
        problem = kv_cache.problem(kv_sizes(gguf, model_dir))
        if problem is not None:
            raise ModelProblem(problem)


def kv_sizes(gguf: Path | None, model_dir: Path | None) -> KVSizes | None:
    """What the model's KV cache is sized by, from the GGUF file's header or config.json; None
    where they do not say, or the model keeps no KV cache (an encoder)."""
    if gguf is not None:
        return gguf_kv_sizes(gguf)
    if model_dir is None:
        return None
    # a JSON object: `check_model_dir` read it, or this package wrote it (`tiny-random`)
    config = json.loads((model_dir / "config.json").read_text())
    return None if is_encoder(config.get("architectures")) else config_kv_sizes(config)


def gguf_kv_sizes(path: Path) -> KVSizes | None:
    """The KV sizes the GGUF file's header gives, or None where it does not give them all as
    scalars (KV heads per layer, as some families store them)."""
    architecture = gguf_fields(path, {"general.architecture"})["general.architecture"]
    names = ("context_length", "block_count", "attention.head_count_kv", "attention.head_count")
    names += ("attention.key_length", "embedding_length")
    found = gguf_fields(path, {f"{architecture}.{name}" for name in names})
    context, layers, kv_heads, heads, head_dim, hidden = (
        found.get(f"{architecture}.{name}") for name in names
    )
    kv_heads = heads if kv_heads is None else kv_heads
    return KVSizes.of(context, layers, kv_heads, head_dim, hidden_size=hidden, heads=heads)


def check_model_dir(path: Path) -> None:
    """Raise `ModelProblem` if the Hugging Face directory `path` will not load."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelProblem(f"{path} is not a model directory: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelProblem(f"{config_file}: cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelProblem(f"{config_file}: not a JSON object")
    try:
        supported_architecture(config.get("architectures"))
    except UnsupportedArchitecture as e:
        raise ModelProblem(f"{path}: {e}") from None
    missing = [f for f in REQUIRED_FIELDS if not isinstance(config.get(f), int)]
    if missing:
        raise ModelProblem(f"{config_file}: no integer {', '.join(missing)}")
    if not (path / "tokenizer.json").is_file():
        raise ModelProblem(f"{path} has no tokenizer.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelProblem(f"{path} has no *.safetensors weights")
    if is_encoder(config.get("architectures")):
        return  # an encoder's loader checks its tensors' names and shapes as it reads them
    shapes: dict[str, list[int]] = {}
    for file in files:
        shapes.update(safetensors_shapes(file))
    check_shapes(config, shapes, path)


def safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape in the safetensors `file`, from its header alone."""
    with file.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise ModelProblem(f"{file}: not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise ModelProblem(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelProblem(f"{file}: not a safetensors file")
    return {
        name: entry.get("shape")
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, list[int]]:
    """The shapes config.json gives the tensors every family names alike: the embeddings, the
    final norm and head, and, by their name under `model.layers.N.`, each layer's attention
    projections, norms and dense feed-forward projections (not the experts: their layout
    differs by family)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "model.embed_tokens.weight": [config["vocab_size"], hidden],
        "lm_head.weight": [config["vocab_size"], hidden],
        "model.norm.weight": [hidden],
        "self_attn.q_proj.weight": [q, hidden],
        "self_attn.k_proj.weight": [kv, hidden],
        "self_attn.v_proj.weight": [kv, hidden],
        "self_attn.o_proj.weight": [hidden, q],
        "self_attn.q_proj.bias": [q],
        "self_attn.k_proj.bias": [kv],
        "self_attn.v_proj.bias": [kv],
        "self_attn.q_norm.weight": [head_dim],
        "self_attn.k_norm.weight": [head_dim],
        "input_layernorm.weight": [hidden],
        "post_attention_layernorm.weight": [hidden],
        "pre_feedforward_layernorm.weight": [hidden],
        "post_feedforward_layernorm.weight": [hidden],
        "mlp.gate_proj.weight": [inter, hidden],
        "mlp.up_proj.weight": [inter, hidden],
        "mlp.down_proj.weight": [hidden, inter],
    }


def check_shapes(config: dict[str, Any], shapes: dict[str, list[int]], path: Path) -> None:
    """Raise `ModelProblem` naming the first tensor whose shape differs from config.json's, a
    layer beyond `num_hidden_layers`, or a layer with no tensors."""
    expected = expected_shapes(config)
    layers = config["num_hidden_layers"]
    seen: set[int] = set()
    for name in sorted(shapes):
        key = name
        match = _LAYER.fullmatch(name)
        if match is not None:
            index, key = int(match.group(1)), match.group(2)
            if index >= layers:
                raise ModelProblem(
                    f"{path}: tensor {name} is of layer {index}, but config.json has "
                    f"num_hidden_layers {layers}"
                )
            seen.add(index)
        want = expected.get(key)
        if want is not None and list(shapes[name]) != want:
            raise ModelProblem(
                f"{path}: tensor {name} has shape {list(shapes[name])}, config.json makes it {want}"
            )
    absent = sorted(set(range(layers)) - seen)
    if absent:
        raise ModelProblem(
            f"{path}: no tensors for layer {absent[0]} of the {layers} config.json has"
        )


def check_gguf(path: Path) -> None:
    """Raise `ModelProblem` if the GGUF file `path` is not one of the families this package
    runs (its `general.architecture`; Mixtral is a llama file with experts)."""
    architecture = gguf_fields(path, {"general.architecture"}).get("general.architecture")
    if not isinstance(architecture, str):
        raise ModelProblem(f"{path}: the GGUF file names no general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelProblem(
            f"{path}: unsupported GGUF architecture {architecture}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (llama with experts: Mixtral)"
        )


# GGUF value types: 0-7 and 10-12 fixed-size scalars by struct code, 8 a string, 9 an array
_SCALARS = {**dict(enumerate("BbHhIif?")), 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_fields(path: Path, keys: set[str]) -> dict[str, Any]:
    """The values of those metadata `keys` of the GGUF file `path` that it has and that are
    scalars or strings, read from its header up to the last of them."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_gguf(data, keys)
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ModelProblem(f"{path}: not a readable GGUF file ({e})") from None


def _parse_gguf(data: mmap.mmap, keys: set[str]) -> dict[str, Any]:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, _, count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} predates version 2")
    at = 24
    found: dict[str, Any] = {}

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return bytes(data[at + 8 : at + 8 + length]).decode(), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _SCALARS:
                return at + n * struct.calcsize(_SCALARS[item])
            for _ in range(n):
                at = skip(item, at)
            return at
        raise ValueError(f"unknown GGUF value type {kind}")

    for _ in range(count):
        if keys <= found.keys():
            break
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if key in keys and kind in _SCALARS:
            found[key] = struct.unpack_from("<" + _SCALARS[kind], data, at)[0]
        elif key in keys and kind == _STRING:
            found[key] = string(at)[0]
        at = skip(kind, at)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m triode.gpu.checks.model",
        description="Check that a model will load; one line and exit status 2 if not.",
    )
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--generation-config", default="auto")
    parser.add_argument("--override-generation-config", default=None)
    kv = parser.add_argument_group("a KV cache given with a context length (both, or neither)")
    kv.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES")
    kv.add_argument("--max-model-len", type=int, default=None)
    kv.add_argument("--dtype", default="auto", choices=sorted(ITEMSIZES))
    kv.add_argument("--tensor-parallel-size", type=int, default=1)
    kv.add_argument("--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    kv_cache = None
    if args.kv_cache_memory is not None and args.max_model_len is not None:
        kv_cache = KVCacheAsked(
            args.kv_cache_memory,
            args.max_model_len,
            args.dtype,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
        )
    try:
        check_model(args.model, args.generation_config, args.override_generation_config, kv_cache)
    except ModelProblem as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
