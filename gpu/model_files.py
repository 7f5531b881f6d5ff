"""What the model runner reads from a Hugging Face model directory besides the architecture:
the weights' tensors, every end-of-sequence id, and the context limit its config allows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .gguf_file import has_manifest, packed_weights


def context_limit(config: object, requested: int | None) -> int:
    """The context limit: the model's, capped by the request. A sliding window does not cap
    it: the attention layers mask the keys older than their window."""
    limit = config.max_position_embeddings  # type: ignore[attr-defined]
    return min(limit, requested) if requested else limit


def eos_token_ids(model_dir: Path, config: object) -> list[int]:
    """Every id that ends a sequence, the main EOS first: generation_config.json's (what
    `generate` stops on; Llama 3 lists its end-of-turn token there too) followed by
    config.json's, without repeats."""
    ids: list[int] = []
    sources = []
    path = model_dir / "generation_config.json"
    if path.is_file():
        sources.append(json.loads(path.read_text()).get("eos_token_id"))
    sources.append(getattr(config, "eos_token_id", None))
    for eos in sources:
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's *.safetensors files, by name, read one at a time."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a model directory, by name, one at a time: its safetensors files' and,
    for a GGUF file's directory, the file's own weights dequantized to float32."""
    yield from safetensors_weights(model_dir)
    if has_manifest(model_dir):
        for name, weight in packed_weights(model_dir):
            yield name, weight.dequantize()
