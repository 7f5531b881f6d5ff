"""Generation configs made to break the server: every value that is no default a request may
give, or one the sampler cannot hold, is refused in one short line before the engine starts
(`python -m triode.gpu.checks.model`, what `triode serve` runs first), whether it comes from
the override, a directory's file or the model's own; and the extreme defaults that pass still
keep a request's disallowed tokens out of the sampler's draws."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from triode.actors import EngineArgs
from triode.gpu.checks.model import main
from triode.gpu.generation_config import (
    MAX_INTEGER,
    MAX_SCALE,
    GenerationConfigError,
    parse_override,
    request_defaults,
)
from triode.gpu.sampler import Sampler
from triode.gpu.sampling_state import SamplingState
from triode.wire import SamplingParams
from triode.wire.messages import MAX_SAMPLING_SCALE

HUGE = 10**400  # an integer JSON carries and no float holds

HOSTILE: list[tuple[str, Any]] = [
    ("temperature", float("nan")),
    ("top_p", float("nan")),
    ("min_p", float("inf")),
    ("repetition_penalty", float("-inf")),
    ("temperature", -0.5),
    ("repetition_penalty", 0),
    ("top_k", -2),
    ("max_new_tokens", 0),
    ("top_p", "0.9"),
    ("temperature", [0.7]),
    ("max_new_tokens", {"value": 5}),
    ("top_k", False),
    # integers past any float (OverflowError before), and past what crosses to the edges
    ("temperature", HUGE),
    ("top_k", HUGE),
    ("max_new_tokens", HUGE),
    ("top_k", 1e30),
    ("max_new_tokens", MAX_INTEGER + 1),
    # past float32's range in the sampler (it drew disallowed tokens)
    ("temperature", 1e39),
    ("temperature", MAX_SCALE * 2),
    ("repetition_penalty", 1e300),
    ("repetition_penalty", 1e-300),
]


def _dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "generation_config.json").write_text(text)
    return path


def _one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 200, message


@pytest.mark.parametrize(("key", "value"), HOSTILE, ids=[f"{k}={v!r:.16}" for k, v in HOSTILE])
def test_a_hostile_value_is_refused_from_the_override_and_the_models_file(
    tmp_path: Path, key: str, value: Any
) -> None:
    # JSON text (NaN and Infinity as Python's json writes them), then the mapping itself
    for override in (json.dumps({key: value}), {key: value}):
        with pytest.raises(GenerationConfigError, match=f"{key} .* is out of range") as caught:
            parse_override(override)
        _one_line(str(caught.value))
    model = _dir(tmp_path / "model", json.dumps({"do_sample": True, key: value}))
    with pytest.raises(GenerationConfigError, match=f"{key} .* is out of range") as caught:
        request_defaults(model)
    _one_line(str(caught.value))


def test_an_override_over_a_hostile_file_value_stands(tmp_path: Path) -> None:
    # the file's value is never taken, so it is not judged (vLLM's way)
    model = _dir(tmp_path / "model", '{"temperature": NaN, "top_k": "many"}')
    assert request_defaults(model, "auto", {"temperature": 0.5, "top_k": 4}) == {
        "temperature": 0.5,
        "top_k": 4,
    }


def test_deep_nesting_is_refused_as_json_that_cannot_be_read(tmp_path: Path) -> None:
    deep = '{"temperature": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(GenerationConfigError, match="not valid JSON") as caught:
        parse_override(deep)
    _one_line(str(caught.value))
    model = _dir(tmp_path / "model", deep)
    with pytest.raises(GenerationConfigError, match="cannot be read as JSON"):
        request_defaults(model)


def test_a_long_value_or_key_is_quoted_short() -> None:
    for override in ({"temperature": "x" * 100_000}, {"y" * 100_000: 1}):
        with pytest.raises(GenerationConfigError) as caught:
            parse_override(override)
        _one_line(str(caught.value))
    # more digits than Python prints: no ValueError of its own while naming it
    for value in (10**5000, [10**5000]):
        with pytest.raises(GenerationConfigError, match=r"top_k <\w+ too long to print>"):
            parse_override({"top_k": value})


@pytest.mark.parametrize(
    "config",
    [
        '{"max_new_tokens": 1' + "0" * 400 + "}",
        '{"top_k": 1e30}',
        '{"temperature": 1e39}',
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_serve_refuses_a_hostile_file_in_one_line_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str
) -> None:
    directory = _dir(tmp_path / "config", config)
    assert main(["tiny-random", "--generation-config", str(directory)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err


def test_the_extreme_defaults_that_pass_keep_disallowed_tokens_out_of_the_draws() -> None:
    vocab, allowed = 64, [3, 40]
    extremes = [
        {"temperature": MAX_SCALE},
        {"temperature": MAX_SCALE, "repetition_penalty": MAX_SCALE},
        {"temperature": 1.0, "repetition_penalty": 1 / MAX_SCALE},
        {"temperature": MAX_SCALE, "top_k": MAX_INTEGER, "min_p": 1e-300},
    ]
    for override in extremes:
        defaults = request_defaults(None, "vllm", override)
        params = SamplingParams(
            temperature=defaults.get("temperature", 1.0),
            top_k=defaults.get("top_k", 0),
            min_p=defaults.get("min_p", 0.0),
            repetition_penalty=defaults.get("repetition_penalty", 1.0),
            allowed_token_ids=allowed,
            max_tokens=4,
        )
        # the prompt repeats a disallowed token, which the penalty then scales
        states = [SamplingState(params, [5, 7, 3], None, vocab) for _ in range(8)]
        for seed in range(16):
            torch.manual_seed(seed)
            logits = torch.randn(8, vocab) * 4
            logits[:, 5] = 0.0
            tokens = Sampler()(logits, states).token_ids
            assert set(tokens) <= set(allowed), (override, tokens)


def test_engine_args_refuse_a_deeply_nested_override_as_json_they_cannot_read() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(override_generation_config="[" * 100_000)


def test_a_config_s_bound_is_a_request_s() -> None:
    assert MAX_SCALE == MAX_SAMPLING_SCALE
