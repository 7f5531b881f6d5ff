"""Tiny random-weight models for tests, and for the `tiny-random` model name (see `loader`).

A tiny model is a real Hugging Face directory written by transformers itself, so the same files
load into transformers (the reference) and into our runner (the thing under test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .cache_paths import converted_dir, default_gguf

_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(
    path: str | Path,
    *,
    architecture: Literal["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"] = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.05,
    tokenizer_from: Path | Literal["bytes"] | None = None,
    seed: int = 0,
    **family: Any,
) -> Path:
    """Write a random-weight model directory at `path` and return it.

    `family` passes the architecture's own config fields (a sliding window, `layer_types`,
    expert counts, Gemma's soft-capping...) to its transformers config class.
    The tokenizer (and so the vocabulary) is `tokenizer_from`'s, else the default model's when it
    was converted already, else a 259-token byte-level one, so a tiny model needs no download;
    `tokenizer_from="bytes"` asks for the byte-level one whatever the cache holds.
    """
    # torch and transformers only for a build: the loader imports this module, and resolving
    # `tiny-random` once it is built needs neither
    import torch
    import transformers
    from transformers import AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None and default_gguf().is_file():
        default = converted_dir(default_gguf())
        tokenizer_from = default if default.is_dir() else None
    if tokenizer_from not in (None, "bytes"):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(path)

    config_name, model_name = _FAMILIES[architecture]
    config_cls = getattr(transformers, config_name)
    model_cls = getattr(transformers, model_name)
    extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[model_cls.__name__],
        initializer_range=initializer_range,
        **extra,
        **family,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        # transformers initialises biases to 0 and norms to 1; random ones make a test notice
        # a bias or norm weight that loads into the wrong place
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.1)
            elif "norm" in name:
                param.normal_(mean=1.0, std=0.1)
    model.save_pretrained(path)
    return path


# architecture -> transformers' config and model class names
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def build_uneven_tiny_model(path: str | Path) -> Path:
    """A tiny Qwen2 (Q/K/V biases, untied LM head) that parallelism splits unevenly, as it
    splits SmolLM2-135M: 3 KV heads over 2 tensor-parallel ranks go 2 + 1, and 3 layers over 2
    pipeline stages go 2 + 1."""
    return build_tiny_model(
        path,
        architecture="qwen2",
        hidden_size=96,
        num_heads=6,
        num_kv_heads=3,
        num_layers=3,
        tie_word_embeddings=False,
    )


def _byte_tokenizer() -> Any:
    """Byte-level BPE with no merges: every byte a token, plus ChatML's special tokens."""
    # only for a build, as in `build_tiny_model`
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {
        t: i for i, t in enumerate(CHATML_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))
    }
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(CHATML_SPECIALS)
    return chatml_tokenizer(backend)


CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer(backend: Any) -> Any:
    """`backend` (a `tokenizers.Tokenizer` holding `CHATML_SPECIALS`) as a transformers
    tokenizer with ChatML's roles and chat template."""
    from transformers import PreTrainedTokenizerFast  # only for a build, as in `build_tiny_model`

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = _CHATML
    return tokenizer
