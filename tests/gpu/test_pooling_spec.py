"""The pooling spec read from a model's config.json and sentence-transformers' files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triode.gpu.pooling_spec import PoolingSpec, is_encoder, pooling_spec

BERT = {"architectures": ["BertModel"], "hidden_size": 384}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024}


def _module(idx: int, path: str, kind: str) -> dict[str, Any]:
    """A modules.json entry as sentence-transformers before 5 writes them."""
    return {
        "idx": idx,
        "name": str(idx),
        "path": path,
        "type": f"sentence_transformers.models.{kind}",
    }


TRANSFORMER = _module(0, "", "Transformer")
POOLING = _module(1, "1_Pooling", "Pooling")
NORMALIZE = _module(2, "2_Normalize", "Normalize")


def _write(
    model_dir: Path, modules: list[dict[str, Any]], files: dict[str, dict[str, Any]] | None = None
) -> Path:
    """`model_dir` with `modules` as its modules.json and `files` (by their relative paths)."""
    (model_dir / "modules.json").write_text(json.dumps(modules))
    for name, content in (files or {}).items():
        path = model_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return model_dir


def test_minilm_files_say_mean_pooling_normalized_and_the_sequence_limit(tmp_path: Path) -> None:
    pooling = {"word_embedding_dimension": 384, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}  # fmt: skip
    model_dir = _write(
        tmp_path,
        [TRANSFORMER, POOLING, NORMALIZE],
        {"1_Pooling/config.json": pooling, "sentence_bert_config.json": {"max_seq_length": 256}},
    )
    spec = pooling_spec(model_dir, BERT)
    assert spec == PoolingSpec(
        task="embed", pooling="mean", normalize=True, dimensions=384, matryoshka=False,
        max_seq_length=256, activation="identity", labels=[],
    )  # fmt: skip
    assert json.loads(json.dumps(spec.as_dict())) == spec.as_dict()
    assert spec.as_dict()["pooling"] == "mean"


def test_a_bert_model_without_sentence_transformers_files_mean_pools_unnormalized(
    tmp_path: Path,
) -> None:
    spec = pooling_spec(tmp_path, BERT)
    assert spec is not None
    assert (spec.task, spec.pooling, spec.normalize, spec.max_seq_length) == (
        "embed", "mean", False, None
    )  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "pooling"),
    [
        ({"pooling_mode_cls_token": True}, "cls"),
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode": "cls"}, "cls"),
        ({"pooling_mode": "lasttoken"}, "last"),
        ({"pooling_mode": ["mean"]}, "mean"),
        ({"embedding_dimension": 384}, "mean"),
    ],
)
def test_the_pooling_module_names_the_mode(
    tmp_path: Path, settings: dict[str, Any], pooling: str
) -> None:
    model_dir = _write(tmp_path, [TRANSFORMER, POOLING], {"1_Pooling/config.json": settings})
    spec = pooling_spec(model_dir, BERT)
    assert spec is not None and spec.pooling == pooling and not spec.normalize


def test_a_decoder_embeds_only_with_a_pooling_module(tmp_path: Path) -> None:
    assert pooling_spec(tmp_path, QWEN3) is None
    _write(tmp_path, [TRANSFORMER])
    assert pooling_spec(tmp_path, QWEN3) is None
    # a Qwen3-Embedding checkpoint, its module types as sentence-transformers 5 writes them
    modules = [
        {**TRANSFORMER, "type": "sentence_transformers.base.modules.Transformer"},
        {**POOLING, "type": "sentence_transformers.sentence_transformer.modules.Pooling"},
        NORMALIZE,
    ]
    pooling = {"embedding_dimension": 1024, "pooling_mode": "lasttoken", "include_prompt": True}
    _write(tmp_path, modules, {"1_Pooling/config.json": pooling})
    spec = pooling_spec(tmp_path, {**QWEN3, "architectures": ["Qwen3Model"]})
    assert spec is not None
    assert (spec.task, spec.pooling, spec.normalize, spec.dimensions) == (
        "embed",
        "last",
        True,
        1024,
    )


@pytest.mark.parametrize(
    "config", [{"is_matryoshka": True}, {"matryoshka_dimensions": [64, 128, 384]}]
)
def test_matryoshka_keys_say_the_embedding_may_be_truncated(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    spec = pooling_spec(tmp_path, {**BERT, **config})
    assert spec is not None and spec.matryoshka
    assert not pooling_spec(tmp_path, BERT).matryoshka  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("config", "labels", "activation"),
    [
        ({"id2label": {"0": "LABEL_0"}}, ["LABEL_0"], "sigmoid"),
        ({"id2label": {"1": "yes", "0": "no", "2": "maybe"}}, ["no", "yes", "maybe"], "identity"),
        ({"num_labels": 1}, ["LABEL_0"], "sigmoid"),
        ({"id2label": {"0": "score"}, "sentence_transformers": {
            "activation_fn": "torch.nn.modules.linear.Identity"}}, ["score"], "identity"),
        ({"id2label": {"0": "a", "1": "b"},
          "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"},
         ["a", "b"], "sigmoid"),
    ],
)  # fmt: skip
def test_a_bert_classifier_classifies_over_its_first_token(
    tmp_path: Path, config: dict[str, Any], labels: list[str], activation: str
) -> None:
    config = {"architectures": ["BertForSequenceClassification"], "hidden_size": 32, **config}
    spec = pooling_spec(tmp_path, config)
    assert spec is not None
    assert (spec.task, spec.pooling, spec.normalize) == ("classify", "cls", False)
    assert (spec.labels, spec.dimensions, spec.activation) == (labels, len(labels), activation)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"pooling_mode": "weightedmean"}, "weightedmean"),
        ({"pooling_mode_max_tokens": True}, "max"),
        ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens"),
        ({"pooling_mode": ["cls", "mean"]}, "cls, mean"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "cls, mean"),
    ],
)
def test_a_pooling_we_do_not_run_is_refused_by_name(
    tmp_path: Path, settings: dict[str, Any], named: str
) -> None:
    model_dir = _write(tmp_path, [TRANSFORMER, POOLING], {"1_Pooling/config.json": settings})
    with pytest.raises(ValueError, match=named):
        pooling_spec(model_dir, BERT)


def test_a_module_that_changes_the_pooled_output_is_refused_by_name(tmp_path: Path) -> None:
    model_dir = _write(tmp_path, [TRANSFORMER, POOLING, _module(2, "2_Dense", "Dense")])
    with pytest.raises(ValueError, match="Dense"):
        pooling_spec(model_dir, BERT)


def test_an_unsupported_classifier_activation_is_refused_by_name(tmp_path: Path) -> None:
    relu = {"activation_fn": "torch.nn.modules.activation.ReLU"}
    config = {"architectures": ["BertForSequenceClassification"], "hidden_size": 32,
              "sentence_transformers": relu}  # fmt: skip
    with pytest.raises(ValueError, match="ReLU"):
        pooling_spec(tmp_path, config)


def test_encoders_are_the_bert_architectures() -> None:
    assert is_encoder(["BertModel"]) and is_encoder(["BertForSequenceClassification"])
    assert not is_encoder(["Qwen3ForCausalLM"]) and not is_encoder(None) and not is_encoder([])
