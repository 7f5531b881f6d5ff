"""Which implementation runs a checkpoint: the architectures its config.json names, looked up
among the families this package implements."""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM, Qwen2ForCausalLM

# config.json's `architectures` name -> the class that runs it
MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


class UnsupportedArchitecture(ValueError):
    """A config.json naming no architecture this package implements."""


def model_class(config: Any) -> type[LlamaForCausalLM]:
    """The implementation for the first architecture in config.json we know."""
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODELS:
            return MODELS[name]
    raise UnsupportedArchitecture(
        f"unsupported architecture {', '.join(architectures) or '(none named)'}; "
        f"supported: {', '.join(sorted(MODELS))}"
    )
