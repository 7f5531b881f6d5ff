"""A step's draws: the tokens each sampling request of a step emits, from the logits of its
rows (`draw`).

A request that samples has one row, the logits of its last known position; a speculating one
(`ScheduledRequest.num_draft_tokens`) has one more per proposal, and its rows go to the
rejection sampler (`rejection_sampler.verify`), which keeps the proposals the model agrees
with and one token of the model's own. The others take the sampler (`sampler.Sampler`) or,
when every row takes its argmax and reports nothing else, the fused argmax over bfloat16
logits; a seeded request draws the same tokens whatever its neighbours do and whether or not
it speculates. A structured output's grammar masks every row of its request first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from triode.wire import Logprobs, ScheduledRequest, SchedulerOutput

from .logits_processing import apply_token_bitmask
from .rejection_sampler import verify
from .sampler import Sampler, SamplerOutput, plain_greedy
from .sampling_state import SamplingState

if TYPE_CHECKING:
    from .cpu_kernels import FusedOps

# what a request emits in a step: its tokens in order, and their logprobs when it asked
Drawn = tuple[list[int], Logprobs | None]


def logit_rows(sampling: list[ScheduledRequest], start: dict[str, int]) -> list[int]:
    """The rows of a step's hidden states whose logits its sampling requests need, in their
    order: each one's last known position, after its proposals' positions where it has them."""
    rows: list[int] = []
    for r in sampling:
        last = start[r.request_id] + len(r.token_ids) - 1
        rows += range(last - r.num_draft_tokens, last + 1)
    return rows


def draw(
    logits: torch.Tensor,
    sampling: list[ScheduledRequest],
    states: list[SamplingState],
    sched: SchedulerOutput,
    sampler: Sampler,
    fused: FusedOps | None,
    await_bitmask: Callable[[], object] | None = None,
) -> list[Drawn]:
    """What each of `sampling` (with its `states`) emits, from `logits` [rows, V] in the order
    of `logit_rows`. A step with constrained rows waits for its bitmask (`await_bitmask`, when
    it is being filled beside the forward) once the logits are there."""
    speculating = any(r.num_draft_tokens for r in sampling)
    if not speculating and fused is not None and not sched.grammar_request_ids:
        if logits.dtype == torch.bfloat16 and plain_greedy(states):
            return [([t], None) for t in fused.argmax(logits).tolist()]
    logits = logits.float().cpu()  # sampling is on the CPU
    if sched.grammar_request_ids:
        if sched.grammar_bitmask is None and await_bitmask is not None:
            await_bitmask()  # filled beside the forward (InProcessExecutor)
        if sched.grammar_bitmask is None:
            raise ValueError("a step with constrained rows came without its bitmask")
        apply_token_bitmask(logits, _grammar_rows(sampling, sched), sched.grammar_bitmask)
    if not speculating:
        return _drawn(sampler(logits, states))
    first, plain, spec = 0, [], []
    for i, r in enumerate(sampling):
        (spec if r.num_draft_tokens else plain).append((i, first))
        first += 1 + r.num_draft_tokens
    out: list[Drawn] = [([], None)] * len(sampling)
    if plain:
        rows = torch.tensor([row for _, row in plain])
        drawn = _drawn(sampler(logits[rows], [states[i] for i, _ in plain]))
        for (i, _), one in zip(plain, drawn, strict=True):
            out[i] = one
    drafts = [sampling[i].draft_token_ids for i, _ in spec]
    pairs = zip(spec, drafts, strict=True)
    rows = torch.tensor([row + j for (_, row), d in pairs for j in range(1 + len(d))])
    verified = verify(logits[rows], [states[i] for i, _ in spec], drafts)
    for (i, _), one in zip(spec, verified, strict=True):
        out[i] = one
    return out


def _drawn(sampled: SamplerOutput) -> list[Drawn]:
    return [([t], lp) for t, lp in zip(sampled.token_ids, sampled.logprobs, strict=True)]


def _grammar_rows(sampling: list[ScheduledRequest], sched: SchedulerOutput) -> list[int]:
    """The logits row of each bitmask row: a constrained request's rows are consecutive in
    both, one per verified position."""
    first: dict[str, int] = {}
    row = 0
    for r in sampling:
        first[r.request_id] = row
        row += 1 + r.num_draft_tokens
    rows: list[int] = []
    previous, offset = None, 0
    for request_id in sched.grammar_request_ids:
        offset = offset + 1 if request_id == previous else 0
        rows.append(first[request_id] + offset)
        previous = request_id
    return rows
