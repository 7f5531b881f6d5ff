"""What one step's result means for a request (`apply_result`): the tokens it emitted, each
checked for a stop (`check_stop`, then for a constrained request `advance_grammar`) before the
next is taken, the proposals it rejected taken back, and which prompt logprob rows are new
(`unsent_prompt_logprobs`). The scheduler applies it to each request of a step whose result
comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triode.wire.messages import EngineCoreOutput, Logprobs
from triode.wire.step import RequestStepResult, ScheduledRequest

from .request import Request, RequestStatus

if TYPE_CHECKING:
    from .scheduler import Scheduler


def apply_result(
    scheduler: Scheduler, req: Request, entry: ScheduledRequest, result: RequestStepResult
) -> EngineCoreOutput | None:
    """Take `req`'s share of a step's results (`entry` what was scheduled, `result` what came
    back): what to tell its client, or None when there is nothing new.

    A speculating request emits the proposals the model accepted and one token of its own;
    its computed tokens go back to the end of the accepted ones, and blocks that only held
    rejected proposals are freed. Tokens after one that stops the request are dropped."""
    if req.pooling_params is not None:
        return _pooled(scheduler, req, entry, result)
    prompt_logprobs = unsent_prompt_logprobs(req, entry, result.prompt_logprobs)
    new_token_ids: list[int] = []
    if result.token_id is not None and entry.sample:
        # never more accepted than were proposed, whatever a worker says
        accepted = result.accepted_token_ids[: entry.num_draft_tokens]
        emitted = [*accepted, result.token_id]
        if entry.num_draft_tokens:
            _take_back(scheduler, req, entry, len(accepted))
        for token_id in emitted:
            req.append_output_token(token_id)
            new_token_ids.append(token_id)
            stop = check_stop(req, scheduler.max_len)
            if req.grammar is not None and stop is None:
                stop = advance_grammar(req, token_id)
            if stop is not None:
                scheduler.running.remove(req)
                scheduler.finish(req, stop)
                break
        if scheduler.drafter is not None and not req.is_finished:
            scheduler.drafter.extend(req, new_token_ids)
    if not new_token_ids and prompt_logprobs is None:
        return None
    logprobs = result.logprobs if new_token_ids else None
    if logprobs is not None and len(logprobs.ranks) > len(new_token_ids):
        logprobs = _first_rows(logprobs, len(new_token_ids))
    return EngineCoreOutput(
        req.request_id,
        new_token_ids=new_token_ids,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        new_logprobs=logprobs,
        new_prompt_logprobs=prompt_logprobs,
        kv_transfer_params=req.kv_transfer_params_out,
        num_cached_tokens=max(0, req.num_cached_tokens),
        weight_version=scheduler.weight_version,
    )


def _pooled(
    scheduler: Scheduler, req: Request, entry: ScheduledRequest, result: RequestStepResult
) -> EngineCoreOutput | None:
    """A pooling request's step: the one that ends its prompt finishes it with its pooled
    output (and frees its blocks); a step before that has nothing to say."""
    if result.pooled is None or not entry.sample:
        return None
    scheduler.running.remove(req)
    scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
    return EngineCoreOutput(
        req.request_id,
        finish_reason=req.status.finish_reason,
        num_cached_tokens=max(0, req.num_cached_tokens),
        weight_version=scheduler.weight_version,
        pooled=result.pooled,
    )


def _take_back(
    scheduler: Scheduler, req: Request, entry: ScheduledRequest, num_accepted: int
) -> None:
    """Count a verification, and move `req`'s computed tokens back from past its proposals to
    the end of the accepted ones, freeing the blocks past what its tokens need."""
    if scheduler.drafter is not None:
        scheduler.drafter.verified(req, entry.num_draft_tokens, num_accepted)
    scheduled_to = entry.num_computed_tokens + len(entry.token_ids)
    if req.num_computed_tokens != scheduled_to:  # preempted meanwhile: it starts over anyway
        return
    req.num_computed_tokens = scheduled_to - entry.num_draft_tokens + num_accepted
    # the model's own token comes after them; the next step computes it
    scheduler.kv_cache.trim(req, req.num_computed_tokens + 1)


def _first_rows(logprobs: Logprobs, n: int) -> Logprobs:
    return Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])


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
