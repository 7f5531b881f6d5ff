"""Token ids a model has no row for: refused where a request enters, at the edge and again in
the engine core (which also takes requests straight from its socket)."""

from __future__ import annotations

from collections.abc import Collection

from triode.wire import SamplingParams


def out_of_vocabulary(
    vocab_size: int,
    *,
    prompt: Collection[int] = (),
    params: SamplingParams | None = None,
    prompt_field: str = "prompt_token_ids",
) -> str | None:
    """ "field: why" for the first token id, in the prompt or the sampling parameters, that the
    model has no row for (it would fail the whole step it ran in); None when all are in range."""
    fields: list[tuple[str, Collection[int]]] = [(prompt_field, prompt)]
    if params is not None:
        fields += [
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", params.logit_bias or ()),
        ]
    for field, ids in fields:
        if ids and max(ids) >= vocab_size:
            return f"{field}: token ids must be < {vocab_size}, the model's vocabulary size"
    return None
