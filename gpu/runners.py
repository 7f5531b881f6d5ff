"""Which runner serves a model (`open_runner`): an encoder (BERT family) runs in the
`EncoderRunner`, without a KV cache; every other model in the `ModelRunner`, which also pools a
decoder's last token when the model is served for embeddings (`runner` "pooling", or a
sentence-transformers directory)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .loader import resolve_model
from .model_runner import ModelRunner
from .pooling_spec import PoolingSpec, is_encoder, pooling_spec

if TYPE_CHECKING:
    from .encoder_runner import EncoderRunner


def open_runner(engine_args: Mapping[str, Any], **placement: Any) -> ModelRunner | EncoderRunner:
    """The runner `engine_args` (`EngineArgs` as builtins) ask for, its model resolved once;
    `placement` as `ModelRunner.from_engine_args`. ValueError for a model that cannot be
    served as asked (an encoder asked to generate, a decoder asked to pool other than its
    last token)."""
    model_dir = resolve_model(engine_args["model"])
    args = {**engine_args, "model": str(model_dir)}
    config = json.loads((model_dir / "config.json").read_text())
    architectures = config.get("architectures")
    wanted = engine_args.get("runner", "auto")
    if is_encoder(architectures):
        if wanted == "generate":
            raise ValueError(
                f"{architectures[0]} is an encoder: it serves embeddings or scores, not text"
            )
        # the encoder's modules load only where an encoder is served
        from .encoder_runner import EncoderRunner

        return EncoderRunner.from_engine_args(args, **placement)
    spec = pooling_spec(model_dir, config) if wanted != "generate" else None
    runner = ModelRunner.from_engine_args(args, **placement)
    if wanted == "pooling" or spec is not None:
        spec = spec or last_token_spec(runner.hidden_size)
        if spec.task != "embed" or spec.pooling != "last":
            raise ValueError(
                f"a decoder pools its last token for embeddings; {model_dir} asks for "
                f"{spec.pooling} pooling ({spec.task})"
            )
        runner.pooling_spec = spec
    return runner


def last_token_spec(hidden_size: int) -> PoolingSpec:
    """How a decoder served for embeddings pools when its files do not say: its last
    position's final hidden state, normalised (as Qwen3's embedding models are used)."""
    return PoolingSpec(
        task="embed",
        pooling="last",
        normalize=True,
        dimensions=hidden_size,
        matryoshka=False,
        max_seq_length=None,
        activation="identity",
        labels=[],
    )
