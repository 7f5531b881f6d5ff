"""What one step's result means for a request: whether the token it sampled stops it
(`check_stop`, then for a constrained request `advance_grammar`), and which prompt logprob rows
are new (`unsent_prompt_logprobs`). The scheduler applies them to each request of a step whose
result comes back.
"""

from __future__ import annotations

from triode.wire.messages import Logprobs
from triode.wire.step import ScheduledRequest

from .request import Request, RequestStatus


def check_stop(req: Request, max_len: int) -> RequestStatus | None:
    """The stop conditions, in order, for the token just appended."""
    params = req.sampling_params
    token = req.output_token_ids[-1]
    if req.num_output_tokens >= params.min_tokens:
        if token == req.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def advance_grammar(req: Request, token_id: int) -> RequestStatus | None:
    """Advance a constrained request's grammar; a token it refuses (its mask allowed only
    the others) finishes the request with an error.

    At the grammar's end the mask allows only end-of-sequence tokens, so the request stops
    on one of those the next step, like any other; only an EOS that `ignore_eos` let
    through stops it here."""
    if not req.grammar.accept(token_id):
        req.stop_reason = f"the output left its grammar: {req.grammar.error}"
        return RequestStatus.FINISHED_ERROR
    if req.grammar.finished and token_id == req.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    return None


def unsent_prompt_logprobs(
    req: Request, entry: ScheduledRequest, logprobs: Logprobs | None
) -> Logprobs | None:
    """Drop the rows a recompute after preemption produced again.

    A chunk starting at position c yields rows for prompt tokens c+1, c+2, ...; rows for tokens
    up to `num_prompt_logprobs_sent` went out before the preemption.
    """
    if logprobs is None:
        return None
    start = entry.num_computed_tokens
    skip = max(0, req.num_prompt_logprobs_sent - start)
    rows = len(logprobs.ranks)
    req.num_prompt_logprobs_sent = max(req.num_prompt_logprobs_sent, start + rows)
    if skip == 0:
        return logprobs
    if skip >= rows:
        return None
    return Logprobs(logprobs.token_ids[skip:], logprobs.logprobs[skip:], logprobs.ranks[skip:])
