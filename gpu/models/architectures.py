"""The architectures this package runs, by the names config.json and GGUF files give them, and
the errors a checkpoint that cannot run raises. No torch here: a start-up check reads it in a
fraction of a second, before any model process starts."""

from __future__ import annotations

# config.json's `architectures` names that a family of this package implements
SUPPORTED = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        # encoders, served for embeddings and scores (`pooling_spec.ENCODER_ARCHITECTURES`)
        "BertModel",
        "BertForSequenceClassification",
    }
)


class UnsupportedArchitecture(ValueError):
    """A config.json naming no architecture this package implements."""


class CheckpointMismatch(ValueError):
    """Checkpoint tensors that do not fit the model its config describes: a name with no
    parameter, a parameter no tensor fills, or a shape that differs."""


def supported_architecture(architectures: list[str] | None) -> str:
    """The first of `architectures` this package runs; UnsupportedArchitecture naming them and
    what is supported otherwise."""
    for name in architectures or []:
        if name in SUPPORTED:
            return name
    named = ", ".join(architectures or []) or "(none named in config.json)"
    raise UnsupportedArchitecture(
        f"unsupported architecture {named}; supported: {', '.join(sorted(SUPPORTED))}"
    )
