"""A PEFT LoRA directory on disk: its two files read once (the digest and the tensors come from
the same bytes, so what runs is what the digest names), its config checked against what triode
runs, and its safetensors header parsed before any tensor is.

Torch-free: the engine core computes digests with it too.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triode.wire import OperationError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections a LoRA may target, and the block of the decoder layer that holds each
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# PEFT options that change the forward pass beyond y += scale * B A x: refused, named
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "kasa_config": "KaSA (kasa_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer_replication",
    "modules_to_save": "modules_to_save",
    "fan_in_fan_out": "fan_in_fan_out",
}
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# an adapter_config.json is a few hundred bytes; PEFT's longest (every option, long patterns) a
# few KB
MAX_CONFIG_BYTES = 1 << 20
# the longest regex `target_modules` (matched against the model's few hundred module names)
MAX_PATTERN = 4096
# what a safetensors file may hold besides its tensors' data: its JSON header
MAX_HEADER_BYTES = 16 << 20
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")
_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<proj>\w+)")


def invalid(message: str) -> OperationError:
    return OperationError("invalid", message)


@dataclass(frozen=True)
class AdapterFiles:
    """The bytes of an adapter directory's config and weights, and their digest."""

    path: Path
    config_bytes: bytes
    weights_bytes: bytes

    @classmethod
    def read(
        cls,
        path: str | Path,
        max_weights_bytes: int | None = None,
        check: Callable[[AdapterFiles], object] | None = None,
    ) -> AdapterFiles:
        """Both files of PEFT directory `path`; `invalid` naming what is missing, or a file
        larger than any adapter of this model can be (`max_weights_bytes`, and `MAX_CONFIG_BYTES`
        for the config): nothing is read into memory past those bounds. `check` sees the
        config first (its weights still empty), so that a config refused is named as such,
        before the weights' size is."""
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise invalid(f"LoRA adapter {str(path)!r} is not a directory")
        config = directory / CONFIG_FILE
        weights = directory / WEIGHTS_FILE
        if not config.is_file():
            raise invalid(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
        if not weights.is_file():
            if (directory / "adapter_model.bin").is_file():
                raise invalid(
                    f"LoRA adapter {str(path)!r} has only adapter_model.bin (a pickle): "
                    f"convert it to safetensors ({WEIGHTS_FILE})"
                )
            raise invalid(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE}")
        _check_size(config, MAX_CONFIG_BYTES)
        config_only = cls(directory, config.read_bytes(), b"")
        if check is not None:
            check(config_only)
        _check_size(weights, max_weights_bytes)
        return cls(directory, config_only.config_bytes, weights.read_bytes())

    @property
    def digest(self) -> str:
        """Hex SHA-256 over both files' names and bytes: any change of content is a new one."""
        h = hashlib.sha256()
        h.update(CONFIG_FILE.encode() + b"\0" + self.config_bytes)
        h.update(b"\0" + WEIGHTS_FILE.encode() + b"\0" + self.weights_bytes)
        return h.hexdigest()

    def config(self) -> dict[str, Any]:
        try:
            config = json.loads(self.config_bytes)
        except ValueError as e:
            raise invalid(f"{self.path / CONFIG_FILE}: not JSON ({e})") from None
        if not isinstance(config, dict):
            raise invalid(f"{self.path / CONFIG_FILE}: not a JSON object")
        return config

    def header(self) -> dict[str, tuple[str, list[int]]]:
        """Each tensor's (dtype, shape) from the safetensors header, before any data is read."""
        data = self.weights_bytes
        try:
            (size,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + size])
            header.pop("__metadata__", None)
            return {name: (str(t["dtype"]), list(t["shape"])) for name, t in header.items()}
        except (struct.error, ValueError, TypeError, KeyError, AttributeError):
            raise invalid(f"{self.path / WEIGHTS_FILE}: not a safetensors file") from None


def _check_size(file: Path, limit: int | None) -> None:
    size = file.stat().st_size
    if limit is not None and size > limit:
        raise invalid(
            f"{file}: {size} bytes, more than any LoRA adapter of this model up to "
            f"--max-lora-rank can hold ({limit})"
        )


def adapter_digest(path: str | Path) -> str:
    """The content digest of the adapter at `path` (what prefix caching keys its blocks by)."""
    return AdapterFiles.read(path).digest


@dataclass(frozen=True)
class LoraSettings:
    """What a PEFT config says about the forward pass: per-module rank and scaling."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scaling(self, module: str) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (both per module where
        alpha_pattern / rank_pattern name it)."""
        alpha = float(_pattern_value(self.alpha_pattern, module, self.alpha))
        r = self.rank(module)
        return alpha / r**0.5 if self.rslora else alpha / r


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first key that matches a suffix of the module's name, as a
    regex."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_config(config: dict[str, Any], where: Path, module_names: list[str]) -> LoraSettings:
    """The settings of a PEFT config that triode can run, else `invalid` naming the problem.
    `module_names` are the base model's Hugging Face module names, which a regex
    `target_modules` is matched against."""
    if config.get("peft_type") != "LORA":
        raise invalid(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise invalid(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise invalid(f"{where}: bias {config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() != "all-linear":
        if len(targets) > MAX_PATTERN:
            raise invalid(f"{where}: target_modules is a regex of over {MAX_PATTERN} characters")
        try:
            named = [m for m in module_names if re.fullmatch(targets, m)]
        except re.error as e:
            raise invalid(f"{where}: target_modules is not a valid regex ({e})") from None
    elif isinstance(targets, list):
        named = [str(t) for t in targets]
    else:
        named = []
    for name in named:
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            raise invalid(
                f"{where}: target module {name!r} is not supported; LoRA targets only "
                f"{', '.join(PROJECTIONS)}"
            )
    try:
        settings = LoraSettings(
            r=int(config["r"]),
            alpha=float(config.get("lora_alpha", 8)),
            rslora=bool(config.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (config.get("rank_pattern") or {}).items()},
            alpha_pattern={
                str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()
            },
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise invalid(
            f"{where}: r, lora_alpha, rank_pattern or alpha_pattern malformed ({e})"
        ) from None
    if settings.r < 1 or any(r < 1 for r in settings.rank_pattern.values()):
        raise invalid(f"{where}: a rank below 1")
    return settings


def lora_module(key: str, num_layers: int) -> tuple[str, str, int, str]:
    """(Hugging Face module name, "A" or "B", layer index, projection) of a PEFT tensor name;
    `invalid` for a tensor triode cannot run, naming it."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise invalid(f"unknown tensor {key!r} in {WEIGHTS_FILE}")
    module = match["module"]
    parts = _MODULE.fullmatch(module)
    if parts is None or PROJECTIONS.get(parts["proj"]) != parts["block"]:
        raise invalid(
            f"{key!r} targets {module!r}; LoRA targets only {', '.join(PROJECTIONS)} "
            "of the decoder layers"
        )
    layer = int(parts["layer"])
    if layer >= num_layers:
        raise invalid(f"{key!r}: layer {layer} of a model of {num_layers} layers")
    return module, match["which"], layer, parts["proj"]


def check_dtype(key: str, dtype: str) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise invalid(f"{key!r} has dtype {dtype}, not a floating point one")
