"""Verification of speculative proposals: how many of a request's proposed tokens the model
accepts, and the one token of its own that follows them.

A request with k proposed tokens owns k + 1 consecutive rows of logits: row j is the model's
distribution after the known tokens and the first j proposals. Each row is processed
(`logits_processing`) as if the output already held those proposals (`SamplingState.ahead`), so
penalties count them and min_tokens sees the longer output.

Greedy requests keep proposals while each equals its row's argmax, then emit the argmax of the
first row that disagrees (or of the last row): what plain greedy decoding gives.

Sampled requests use rejection sampling with a deterministic proposer, whose distribution is
one-hot: proposal j is accepted with probability p_j(d_j), p_j being the distribution the
sampler draws row j from (`min_p_logits`, `truncated_candidates`: after temperature, top-k,
top-p and min-p). The first rejected row emits a draw from p_j without d_j, renormalised (the
truncation stays what it was); if every proposal is accepted, the last row emits a draw from its
p. The emitted tokens are then distributed exactly as tokens sampled one at a time. Draws are
the sampler's own (`draw_plain`, `draw_candidates`).

A seeded request instead draws each of its rows in turn as the sampler would, from its own
generator, and keeps the proposal while the draw equals it; the first draw that differs is
its token. That is the same rejection sampling (the draw equals d_j with probability p_j(d_j),
and otherwise is distributed as p_j without d_j, renormalised), and its generator advances by
one draw per emitted token whatever was proposed: a seeded request emits the tokens sampling
one at a time would, bit for bit, however many proposals each step verified. How many that
is depends on the step's timing (`Drafter.plan`), so nothing less would make it repeat.

Logprobs describe the raw model distribution, as the sampler's do: one row per emitted token,
from the row it was emitted at.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from triode.wire.messages import Logprobs

from .logits_processing import needs_processing, process_logits
from .sampler import (
    compute_logprobs,
    draw_candidates,
    draw_plain,
    min_p_logits,
    truncated_candidates,
)
from .sampling_state import SamplingState


@dataclass
class _Group:
    """What the rows of requests verified alike (greedy, plain or truncated) came to."""

    greedy: bool
    # greedy: each row's argmax. Truncated: the candidates' temperature-scaled log-weights.
    # Plain: the logits after min-p, unscaled.
    values: torch.Tensor
    # truncated: the candidates' token ids; else None (the columns are the vocabulary)
    ids: torch.Tensor | None = None
    # what a seeded request drew at each of its rows it drew at (-1 elsewhere)
    drawn: torch.Tensor | None = None


def verify(
    logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]]
) -> list[tuple[list[int], Logprobs | None]]:
    """Verify each request's proposals `drafts[i]` against its rows of `logits`.

    `logits` is [R, V] float32 on the CPU with R = sum(len(d) + 1 for d in drafts), grammar
    masks already applied; request i owns len(drafts[i]) + 1 consecutive rows, in order. Returns
    per request the tokens this step emits (the accepted proposals, then one token of the
    model's own) and, when the request asked for logprobs, a Logprobs with one row per emitted
    token (column 0 the emitted token, then the params.logprobs best), else None.

    `logits` is never modified. Does not append the tokens to the states: the runner does.
    Raises ValueError when the rows do not match the states and drafts, or a proposed token is
    outside the vocabulary.
    """
    if len(drafts) != len(states):
        raise ValueError(f"{len(drafts)} drafts for {len(states)} states")
    counts = [len(d) + 1 for d in drafts]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"{logits.shape[0]} rows of logits for {sum(counts)} verify rows")
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    row_states = _row_states(states, drafts)
    # The proposal each row tests; -1 on a request's last row, which tests none.
    proposed = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64)
    if any(t < 0 or t >= logits.shape[1] for d in drafts for t in d):
        raise ValueError(f"proposed token ids must be in [0, {logits.shape[1]})")

    x = logits.float()
    if any(needs_processing(s) for s in row_states):
        owned = x is not logits and x.is_contiguous()
        x = process_logits(
            x if owned else x.clone(memory_format=torch.contiguous_format), row_states
        )

    accepted = torch.zeros(len(proposed), dtype=torch.bool)
    local = torch.empty(len(proposed), dtype=torch.int64)  # each row's place in its group
    groups: list[tuple[list[int], _Group]] = []
    for requests in _partition(states):
        group_counts = [counts[i] for i in requests]
        rows = _rows([starts[i] for i in requests], group_counts)
        within = list(itertools.accumulate(group_counts, initial=0))[:-1]
        local[rows] = torch.arange(len(rows))
        group, accepted[rows] = _test(
            _take(x, rows),
            proposed[rows],
            row_states if len(rows) == len(row_states) else [row_states[r] for r in rows.tolist()],
            [(states[i], at, len(drafts[i])) for i, at in zip(requests, within, strict=True)],
        )
        groups.append((requests, group))

    # Each request emits at its first row whose proposal was not accepted: its last row at the
    # latest.
    refused = (~accepted).nonzero().squeeze(1)
    emit_rows = refused[torch.searchsorted(refused, torch.tensor(starts))]
    emitted = torch.empty(len(states), dtype=torch.int64)
    for requests, group in groups:
        index = torch.tensor(requests)
        rows = emit_rows[index]
        at = local[rows]
        if group.greedy:
            emitted[index] = group.values[at]
            continue
        seeded = torch.tensor([states[i].generator is not None for i in requests])
        if seeded.any():
            assert group.drawn is not None  # `_test` drew the seeded requests' rows
            emitted[index[seeded]] = group.drawn[at[seeded]]
        if not seeded.all():
            free = ~seeded
            emitted[index[free]] = _draw_without(
                group.values[at[free]],
                None if group.ids is None else group.ids[at[free]],
                proposed[rows[free]],
                [states[i] for i, s in zip(requests, seeded.tolist(), strict=True) if not s],
                x.shape[1],
            )

    accepted_counts = (emit_rows - torch.tensor(starts)).tolist()
    tokens = [
        [*d[:a], t] for d, a, t in zip(drafts, accepted_counts, emitted.tolist(), strict=True)
    ]
    return list(zip(tokens, _logprobs(logits, states, starts, tokens), strict=True))


def _test(
    x: torch.Tensor,
    proposed: torch.Tensor,
    row_states: list[SamplingState],
    requests: list[tuple[SamplingState, int, int]],
) -> tuple[_Group, torch.Tensor]:
    """The rows `x` of some requests verified alike: what they came to, and whether each row's
    proposal `proposed` (-1: none) is accepted. `requests`: each one's state, first row in `x`
    and number of proposals."""
    first = requests[0][0]
    if first.greedy:
        best = _argmax(x)
        return _Group(True, best), best == proposed
    if first.truncates:
        group = _Group(False, *truncated_candidates(x, row_states))
        log_weights = group.values
    else:
        group = _Group(False, min_p_logits(x, row_states))
        log_weights = group.values / _temperatures(row_states)
    p = _log_prob_of(log_weights, group.ids, proposed).exp_()
    # u < p with u uniform on [0, 1) accepts with probability p; rows without a proposal have p
    # 0 (or NaN where nothing survives) and accept nothing.
    accepted = torch.rand(len(x)) < p
    seeded = [(s, first, n) for s, first, n in requests if s.generator is not None]
    if seeded:
        group.drawn = torch.full((len(x),), -1, dtype=torch.int64)
        for s, first, n in seeded:
            accepted[first : first + n + 1] = False
            for row in range(first, first + n + 1):
                group.drawn[row] = _draw_row(group, row, s, x.shape[1])
                if group.drawn[row] != proposed[row]:  # the last row proposes -1
                    break
                accepted[row] = True
    return group, accepted


def _draw_row(group: _Group, row: int, state: SamplingState, vocab: int) -> int:
    """The sampler's draw for one row of `group`, from `state`'s generator."""
    values = group.values[row : row + 1]
    if group.ids is None:
        return int(draw_plain(values, [state]))
    return int(draw_candidates(values, group.ids[row : row + 1], [state], vocab))


def _rows(firsts: list[int], counts: list[int]) -> torch.Tensor:
    """The rows of requests starting at `firsts` with `counts` rows each, in order."""
    n = torch.tensor(counts)
    before = n.cumsum(0) - n
    return (
        torch.tensor(firsts).repeat_interleave(n)
        + torch.arange(int(n.sum()))
        - (before.repeat_interleave(n))
    )


def _row_states(states: list[SamplingState], drafts: list[list[int]]) -> list[SamplingState]:
    """One state per row: row j of a request whose processing reads its output (penalties,
    min_tokens) sees the output with the first j proposals appended."""
    rows: list[SamplingState] = []
    for s, d in zip(states, drafts, strict=True):
        if s.penalized or s.min_tokens_ids is not None:
            rows.append(s)
            rows.extend(s.ahead(d[:j]) for j in range(1, len(d) + 1))
        else:
            rows.extend([s] * (len(d) + 1))
    return rows


def _partition(states: list[SamplingState]) -> list[list[int]]:
    """The requests, greedy, plain and truncated apart (each group's rows are sampled alike)."""
    greedy = [i for i, s in enumerate(states) if s.greedy]
    plain = [i for i, s in enumerate(states) if not s.greedy and not s.truncates]
    truncated = [i for i, s in enumerate(states) if s.truncates]
    return [group for group in (greedy, plain, truncated) if group]


def _log_prob_of(
    values: torch.Tensor, ids: torch.Tensor | None, tokens: torch.Tensor
) -> torch.Tensor:
    """log p(tokens[r]) under row r's log-weights `values` over columns `ids`; -inf for a token
    outside the row's support or -1."""
    if ids is None:
        at = values.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
        at = at.masked_fill(tokens < 0, -math.inf)
    else:
        at = values.masked_fill(ids != tokens.unsqueeze(1), -math.inf).amax(dim=-1)
    return at - _logsumexp(values)


def _draw_without(
    values: torch.Tensor,
    ids: torch.Tensor | None,
    excluded: torch.Tensor,
    states: list[SamplingState],
    vocab: int,
) -> torch.Tensor:
    """One token per row, by the sampler's draw, from what the sampler would draw it from
    (`values` and `ids` as in `_Group`) without token `excluded[r]` (-1: none): the remaining
    probabilities renormalised."""
    columns = torch.arange(vocab) if ids is None else ids
    values = values.masked_fill(columns == excluded.unsqueeze(1), -math.inf)
    if ids is None:
        return draw_plain(values, states)
    return draw_candidates(values, ids, states, vocab)


def _logprobs(
    logits: torch.Tensor, states: list[SamplingState], starts: list[int], tokens: list[list[int]]
) -> list[Logprobs | None]:
    """Raw logprobs of each emitted token, at the row it was emitted from, for the requests
    that asked for them."""
    out: list[Logprobs | None] = [None] * len(states)
    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not wanted:
        return out
    rows = [starts[i] + j for i in wanted for j in range(len(tokens[i]))]
    targets = torch.tensor([t for i in wanted for t in tokens[i]])
    num_top = [states[i].params.logprobs or 0 for i in wanted]
    batch = compute_logprobs(_take(logits, torch.tensor(rows)), targets, max(num_top))
    offset = 0
    for i, k in zip(wanted, num_top, strict=True):
        end = offset + len(tokens[i])
        out[i] = Logprobs(
            token_ids=np.ascontiguousarray(batch.token_ids[offset:end, : 1 + k]),
            logprobs=np.ascontiguousarray(batch.logprobs[offset:end, : 1 + k]),
            ranks=batch.ranks[offset:end].copy(),
        )
        offset = end
    return out


def _temperatures(states: list[SamplingState]) -> torch.Tensor:
    return torch.tensor([s.params.temperature for s in states], dtype=torch.float32).unsqueeze(1)


def _logsumexp(values: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp, -inf for a row of -inf; in three passes, several times faster
    than torch.logsumexp over wide rows on the CPU."""
    top = values.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(values.dtype).min)
    return (values - top).exp_().sum(dim=-1).log_() + top.squeeze(1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first on ties, as the sampler picks it."""
    return torch.max(x, dim=-1).indices


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x's `rows` (increasing): x itself when they are all of them, else a copy."""
    return x if len(rows) == x.shape[0] else x[rows]
