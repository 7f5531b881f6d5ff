"""`--speculative-config` in vLLM's spelling: what it takes, its defaults, and what it refuses
(the operator's flag: a bad value stops the start with its name, before any process runs)."""

from __future__ import annotations

import json

import pytest

from triode.actors.config import EngineArgs
from triode.actors.core.speculation.config import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    parse_speculative_config,
)
from triode.edge.cli import build_parser
from triode.edge.commands.engine_flags import given_engine_args


def test_vllm_spellings_parse_with_vllm_defaults() -> None:
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    only_max = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    suffix = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8})
    assert suffix.suffix_decoding_max_tree_depth == 24
    assert suffix.suffix_decoding_min_token_prob == 0.1
    assert parse_speculative_config(suffix) is suffix


def test_the_serve_flag_reaches_the_engine_args_as_the_filled_in_dict() -> None:
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4})  # fmt: skip
    args = build_parser().parse_args(["serve", "--speculative-config", text])
    engine = EngineArgs(**given_engine_args(args))
    assert engine.speculative_config is not None
    assert engine.speculative_config["prompt_lookup_min"] == 2
    assert SpeculativeConfig(**engine.speculative_config).num_speculative_tokens == 4
    assert EngineArgs().speculative_config is None


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        (
            f'{{"method": "ngram", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS + 1}}}',
            "num_speculative_tokens",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 3}',
            "prompt_lookup",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 65}',
            "prompt_lookup",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 2, '
            '"suffix_decoding_max_tree_depth": 100000}',
            "depth",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 2, '
            '"suffix_decoding_max_cached_requests": 10000000}',
            "cached_requests",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown field"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "max_verify_rows": 0}',
            "max_verify_rows",
        ),
        ("not json", "not JSON"),
        ("{" + " " * 5000 + "}", "4096"),
    ],
)
def test_bad_configs_are_refused_by_name(value: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        EngineArgs(speculative_config=value)
