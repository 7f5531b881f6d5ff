"""The `triode serve` command line: flags in vLLM's spelling, keys from flags and environment."""

from __future__ import annotations

import pytest

from triode.edge.auth import keys_from
from triode.edge.cli import ENGINE_FLAGS, build_parser


def _serve(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "argv",
    [["--api-key", "a", "--api-key", "b"], ["--api-key", "a", "b"]],
)
def test_two_spellings_give_two_keys(argv: list[str]) -> None:
    args = _serve(*argv)
    assert args.api_key == ["a", "b"]
    assert keys_from(args.api_key, {"TRIODE_API_KEY": "c, a,"}) == ["a", "b", "c"]


def test_model_is_positional_and_optional() -> None:
    assert _serve().model is None
    assert _serve("tiny-random", "--port", "0").model == "tiny-random"


def test_engine_flags_reach_the_engine_only_when_given() -> None:
    args = _serve("--max-model-len", "2048", "--kv-cache-memory", "1GiB", "--dtype", "float32",
                  "--no-enable-prefix-caching", "--quantization", "none")  # fmt: skip
    given = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    assert given == {
        "quantization": "none",
        "max_model_len": 2048,
        "kv_cache_memory": "1GiB",
        "dtype": "float32",
        "enable_prefix_caching": False,
    }
    defaults = _serve()
    assert all(getattr(defaults, k) is None for k in ENGINE_FLAGS if k != "dtype")


def test_a_bad_dtype_is_refused() -> None:
    with pytest.raises(SystemExit):
        _serve("--dtype", "int4")


def test_quantization_is_auto_or_none_on_the_command_line_and_in_engine_args() -> None:
    from triode.actors.config import EngineArgs

    with pytest.raises(SystemExit):
        _serve("--quantization", "gptq")
    assert EngineArgs().quantization == "auto"
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="gptq")
