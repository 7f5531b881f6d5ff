"""What a pooling model returns and how: read from its config.json and the files
sentence-transformers ships beside it (modules.json, the Pooling module's config.json,
sentence_bert_config.json). No torch here: start-up checks read it before any model process
starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# config.json's `architectures` names the encoder runner (`encoder_runner`) runs
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})
CLASSIFIERS = frozenset({"BertForSequenceClassification"})

# sentence-transformers' pooling modes (new `pooling_mode` names and legacy
# `pooling_mode_*` keys) -> ours; the modes missing here are refused by name
POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# the sentence-transformers modules whose work is ours: the encoder itself, the pooling, and
# the normalisation the engine applies; any other (Dense, a Router...) would change the output
RUN_MODULES = frozenset({"Transformer", "Pooling", "Normalize"})
# a CrossEncoder's `activation_fn` (a torch class path) -> the activation the engine applies
ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


@dataclass(frozen=True)
class PoolingSpec:
    """What a pooling model's runner returns and what the engine does with it after.

    `task` "embed": the runner returns the pooled hidden state (`pooling` "mean" over the
    prompt's tokens, "cls" its first token, "last" its last), `dimensions` wide; the engine
    may truncate it where `matryoshka` says the model was trained for that, then normalises it
    where `normalize` says. `task` "classify": the runner returns a classification head's
    `dimensions` logits, one per label of `labels`, and the engine applies `activation`
    ("sigmoid", "identity" or "tanh"). `max_seq_length` caps the prompt where the model
    was trained on shorter ones than its position embeddings allow.
    """

    task: str
    pooling: str
    normalize: bool
    dimensions: int
    matryoshka: bool
    max_seq_length: int | None
    activation: str
    labels: list[str]

    def as_dict(self) -> dict[str, Any]:
        """The spec as builtins (the engine's ready info)."""
        return asdict(self)


def is_encoder(architectures: list[str] | None) -> bool:
    """Whether config.json's `architectures` names a model the encoder runner runs."""
    return any(name in ENCODER_ARCHITECTURES for name in architectures or [])


def pooling_spec(model_dir: Path, config: dict[str, Any]) -> PoolingSpec | None:
    """The pooling spec of the model in `model_dir` (`config`: its config.json), or None for a
    model that does not pool (a decoder without sentence-transformers' modules.json).

    A BERT classifier classifies over its first token; a BertModel, or any model whose
    modules.json names a Pooling module, embeds, with sentence-transformers' defaults (mean
    pooling, no normalisation) where its files say nothing. Raises ValueError for what we
    would compute differently from sentence-transformers: a pooling mode we do not run, several
    modes concatenated, a module after the pooling that changes its output.
    """
    architectures = config.get("architectures") or []
    if any(name in CLASSIFIERS for name in architectures):
        labels = _labels(config)
        return PoolingSpec(
            task="classify",
            pooling="cls",
            normalize=False,
            dimensions=len(labels),
            matryoshka=False,
            max_seq_length=_max_seq_length(model_dir),
            activation=_activation(config, len(labels)),
            labels=labels,
        )
    modules = _modules(model_dir)
    pooling_dir = next((path for kind, path in modules if kind == "Pooling"), None)
    if "BertModel" not in architectures and pooling_dir is None:
        return None
    unsupported = [kind for kind, _ in modules if kind not in RUN_MODULES]
    if unsupported:
        raise ValueError(
            f"{model_dir / 'modules.json'}: module {unsupported[0]!r} is not supported (only "
            f"{', '.join(sorted(RUN_MODULES))} modules run)"
        )
    return PoolingSpec(
        task="embed",
        pooling=_pooling_mode(model_dir / pooling_dir) if pooling_dir is not None else "mean",
        normalize=any(kind == "Normalize" for kind, _ in modules),
        dimensions=int(config["hidden_size"]),
        matryoshka=bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")),
        max_seq_length=_max_seq_length(model_dir),
        activation="identity",
        labels=[],
    )


def _modules(model_dir: Path) -> list[tuple[str, str]]:
    """modules.json's modules as (class name, directory relative to `model_dir`); [] without
    the file."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    found = []
    for entry in json.loads(path.read_text()):
        # "sentence_transformers.models.Pooling" before v5, a deeper path since
        kind = str(entry.get("type", "")).rpartition(".")[2]
        found.append((kind, str(entry.get("path", ""))))
    return found


def _pooling_mode(pooling_dir: Path) -> str:
    """The Pooling module's mode from its config.json (mean where there is none)."""
    path = pooling_dir / "config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    mode = settings.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in LEGACY_POOLING_KEYS.items() if settings.get(key)]
        mode = modes or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, list):
        raise ValueError(f"{path}: pooling modes {', '.join(mode)} concatenated are not supported")
    if mode not in POOLING_MODES:
        raise ValueError(
            f"{path}: pooling mode {mode!r} is not supported "
            f"(supported: {', '.join(sorted(POOLING_MODES))})"
        )
    return POOLING_MODES[mode]


def _max_seq_length(model_dir: Path) -> int | None:
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    length = json.loads(path.read_text()).get("max_seq_length")
    return int(length) if length is not None else None


def _labels(config: dict[str, Any]) -> list[str]:
    """The classifier's labels in id order: config.json's `id2label`, else `num_labels` of
    transformers' default names."""
    id2label = config.get("id2label")
    if id2label:
        return [str(id2label[key]) for key in sorted(id2label, key=int)]
    return [f"LABEL_{i}" for i in range(int(config.get("num_labels", 2)))]


def _activation(config: dict[str, Any], num_labels: int) -> str:
    """sentence-transformers CrossEncoder's activation: the one config.json names, else
    sigmoid for a single score and the raw logits for several labels."""
    named = (config.get("sentence_transformers") or {}).get("activation_fn")
    # before sentence-transformers 4 the class path was stored under this key
    named = named or config.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid" if num_labels == 1 else "identity"
    activation = ACTIVATIONS.get(str(named).rpartition(".")[2])
    if activation is None:
        raise ValueError(
            f"activation {named!r} is not supported (supported: torch's "
            f"{', '.join(sorted(ACTIVATIONS))})"
        )
    return activation
