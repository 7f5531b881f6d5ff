"""What a draft-free proposer offers the scheduler, and the one `--speculative-config` names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from triode.actors.core.speculation.config import SpeculativeConfig
from triode.actors.core.speculation.ngram import NgramProposer
from triode.actors.core.speculation.suffix import SuffixProposer


class Proposer(Protocol):
    """Proposals from each request's tokens so far, called from the scheduler's one thread."""

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request begins with this prompt; called once per request."""
        ...

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens appended to the request's output, in order."""
        ...

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses at the next tokens (maybe none)."""
        ...

    def stop(self, request_id: str) -> None:
        """The request ended (finished or aborted); idempotent, unknown ids ignored."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for `config.method`."""
    if config.method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config)
