"""Which implementation runs a checkpoint: the architectures its config.json names, looked up
among the families this package implements."""

from __future__ import annotations

from typing import Any

from .architectures import supported_architecture
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, Qwen2ForCausalLM
from .mixtral import MixtralForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

# config.json's `architectures` name -> the class that runs it
MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(config: Any) -> type[LlamaForCausalLM]:
    """The implementation for the first architecture in config.json we run
    (`UnsupportedArchitecture` where there is none)."""
    return MODELS[supported_architecture(getattr(config, "architectures", None))]
