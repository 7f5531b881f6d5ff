"""A model's generation config as request defaults, vLLM's way: `auto` reads the model's file,
`vllm` none, a directory its file; the override lies over either; only the sampling values vLLM
takes become defaults, max_new_tokens as max_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from triode.gpu.generation_config import (
    DEFAULT_MODEL_CARD,
    GenerationConfigError,
    parse_override,
    request_defaults,
)

MODEL_FILE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "max_new_tokens": 512,
}


def _dir(path: Path, config: object) -> Path:
    path.mkdir()
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_takes_the_sampling_values_of_the_models_file(tmp_path: Path) -> None:
    model = _dir(tmp_path / "model", MODEL_FILE)
    assert request_defaults(model) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 512,
    }


def test_auto_without_a_file_and_vllm_give_no_defaults(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    assert request_defaults(tmp_path / "bare") == {}
    assert request_defaults(None) == {}
    model = _dir(tmp_path / "model", MODEL_FILE)
    assert request_defaults(model, "vllm") == {}


def test_a_directory_replaces_the_models_file(tmp_path: Path) -> None:
    model = _dir(tmp_path / "model", MODEL_FILE)
    other = _dir(tmp_path / "other", {"min_p": 0.05, "repetition_penalty": 1.1, "top_k": None})
    assert request_defaults(model, str(other)) == {"min_p": 0.05, "repetition_penalty": 1.1}


def test_a_directory_without_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GenerationConfigError, match=r"no generation_config\.json there"):
        request_defaults(None, str(tmp_path))


def test_the_override_lies_over_the_file_or_over_nothing(tmp_path: Path) -> None:
    model = _dir(tmp_path / "model", MODEL_FILE)
    override = '{"temperature": 0, "max_new_tokens": 16, "min_p": 0.1}'
    assert request_defaults(model, "auto", override) == {
        "temperature": 0.0,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 16,
        "min_p": 0.1,
    }
    assert request_defaults(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("{temperature: 1}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"temprature": 0.5}', "unknown key 'temprature'; known: temperature, top_p"),
        ('{"max_tokens": 5}', "unknown key 'max_tokens'"),
        ('{"top_p": 0}', "top_p 0 is out of range"),
        ('{"temperature": -1}', "temperature -1 is out of range"),
        ('{"max_new_tokens": 2.5}', "max_new_tokens 2.5 is out of range"),
        ('{"top_k": true}', "top_k True is out of range"),
    ],
)
def test_an_override_that_gives_no_defaults_is_refused(override: str, message: str) -> None:
    with pytest.raises(GenerationConfigError, match=re.escape(message)):
        parse_override(override)


def test_a_models_file_that_is_not_json_is_named(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text("{")
    with pytest.raises(GenerationConfigError, match="cannot be read as JSON"):
        request_defaults(model)


def test_a_file_over_a_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"pad": "x" * (1 << 20)}))
    with pytest.raises(GenerationConfigError, match="over 1048576 bytes"):
        request_defaults(tmp_path)


def test_a_model_card_stands_in_for_a_missing_file_under_auto_only(tmp_path: Path) -> None:
    """The default model's GGUF carries no generation config; its card's recommendation is the
    default then, as a file would be: `vllm` drops it, an override lies over it, and a file
    the model has wins."""
    (tmp_path / "bare").mkdir()
    bare = tmp_path / "bare"
    assert request_defaults(bare, card=DEFAULT_MODEL_CARD) == {"temperature": 0.2, "top_p": 0.9}
    assert request_defaults(bare, "vllm", card=DEFAULT_MODEL_CARD) == {}
    over = request_defaults(bare, "auto", '{"temperature": 0.7}', card=DEFAULT_MODEL_CARD)
    assert over == {"temperature": 0.7, "top_p": 0.9}
    model = _dir(tmp_path / "model", MODEL_FILE)
    assert request_defaults(model, card=DEFAULT_MODEL_CARD)["temperature"] == 0.6
