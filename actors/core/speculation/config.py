"""`--speculative-config`, in vLLM's spelling: which proposer, how many tokens it proposes, and
its own knobs. Torch-free: the engine arguments check it, the engine core runs it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from triode.wire.json_config import parse_config

METHODS = ("ngram", "suffix")
# the most tokens one step may propose for a request: every one is a row of the verify forward
MAX_SPECULATIVE_TOKENS = 32
# at this factor a one-token match may already propose every token a step verifies, so a larger
# one changes no proposal; the bound keeps `match * factor` finite, as the proposer's `int()` of
# it needs (an infinite factor, or one past ~1e305, raises there, on the engine core's thread)
MAX_SPEC_FACTOR = float(MAX_SPECULATIVE_TOKENS)


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `{"method": "ngram", "num_speculative_tokens": k, ...}` asks for.

    ngram (prompt lookup): the longest suffix of the sequence, between `prompt_lookup_min` and
    `prompt_lookup_max` tokens, that occurred before in the prompt or the output proposes the
    tokens that followed it (both unset: 5 and 5, as vLLM; one unset: the other).

    suffix (Arctic Inference's suffix decoding): suffix trees over the request's prompt and
    output and over the outputs of the last `suffix_decoding_max_cached_requests` requests,
    matched on up to `suffix_decoding_max_tree_depth` tokens, propose the most frequent
    continuation while its estimated probability stays at least
    `suffix_decoding_min_token_prob`, and at most `suffix_decoding_max_spec_factor` (itself at
    most `MAX_SPEC_FACTOR`) tokens per matched token (and `num_speculative_tokens`).

    `disable_by_batch_size`: no proposals in a step with more running requests than this (None:
    the cost model alone decides, `drafter`). `max_verify_rows`: the most rows (decodes, prompt
    chunks and proposals together) a step with proposals may have; None: no bound but the cost
    model's.
    """

    method: Literal["ngram", "suffix"]
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    max_verify_rows: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if not 1 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError("suffix_decoding_max_tree_depth must be in [1, 256]")
        if not 0 <= self.suffix_decoding_max_cached_requests <= 1_000_000:
            raise ValueError("suffix_decoding_max_cached_requests must be in [0, 1000000]")
        if not 0 < self.suffix_decoding_max_spec_factor <= MAX_SPEC_FACTOR:
            raise ValueError(f"suffix_decoding_max_spec_factor must be in (0, {MAX_SPEC_FACTOR:g}]")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if self.max_verify_rows is not None and self.max_verify_rows < 1:
            raise ValueError("max_verify_rows must be >= 1")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
    """A config from its JSON text (the CLI's), a dict, or itself; ValueError when invalid."""
    return parse_config(value, SpeculativeConfig, "speculative_config", max_chars=4096)
