"""A rank's LoRA limits, as `ModelRunner(lora_config=...)` takes them and as the engine's
arguments give them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoraLimits:
    """`max_loras` distinct adapters in one step, `max_cpu_loras` resident at once, ranks up to
    `max_lora_rank`, kept in `lora_dtype` ("auto": the model's)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    lora_dtype: str = "auto"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LoraLimits:
        """The limits of a `lora_config` mapping (missing keys take the defaults;
        `max_cpu_loras` None: `max_loras`); ValueError for values that cannot work."""
        max_loras = int(config.get("max_loras", 1))
        cpu = config.get("max_cpu_loras")
        limits = cls(
            max_loras=max_loras,
            max_lora_rank=int(config.get("max_lora_rank", 16)),
            max_cpu_loras=max_loras if cpu is None else int(cpu),
            lora_dtype=str(config.get("lora_dtype", "auto")),
        )
        if limits.max_loras < 1 or limits.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if limits.max_cpu_loras < limits.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        if limits.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype {limits.lora_dtype!r} is not one of {LORA_DTYPES}")
        return limits


def lora_config_of(engine_args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The runner's `lora_config` from an engine's arguments: None unless `enable_lora` (an
    engine whose arguments predate LoRA has none of these keys: disabled)."""
    if not engine_args.get("enable_lora"):
        return None
    return {
        "max_loras": engine_args.get("max_loras", 1),
        "max_lora_rank": engine_args.get("max_lora_rank", 16),
        "max_cpu_loras": engine_args.get("max_cpu_loras"),
        "lora_dtype": engine_args.get("lora_dtype", "auto"),
    }
