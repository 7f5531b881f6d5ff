"""What `Engine.generate` yields: cumulative per-request results, like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triode.wire import Logprobs


@dataclass(slots=True)
class TokenLogprob:
    """A position's log-probability: the token at it, its rank in the vocabulary (1 = most
    likely), and the top alternatives in descending order."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # for prompt tokens 1.. (token 0 has none)
    # a KV connector's params for another instance (disaggregated prefill), on the last output
    kv_transfer_params: dict[str, Any] | None = None
    # the weights that made the latest tokens (0: those the engine started with; one more per
    # weight update)
    weight_version: int = 0


def token_logprobs(logprobs: Logprobs) -> list[TokenLogprob]:
    ids = logprobs.token_ids.tolist()
    values = logprobs.logprobs.tolist()
    ranks = logprobs.ranks.tolist()
    return [
        TokenLogprob(
            row_ids[0], row_values[0], rank, list(zip(row_ids[1:], row_values[1:], strict=True))
        )
        for row_ids, row_values, rank in zip(ids, values, ranks, strict=True)
    ]
