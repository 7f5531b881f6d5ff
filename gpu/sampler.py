"""The sampler: next tokens (and their logprobs) from the last-position logits of a batch.

Semantics follow vLLM V1. Logprobs describe the raw model distribution. The logits are then
processed in this order: allowed_token_ids, logit_bias, min_tokens, penalties (repetition over
prompt + output, presence and frequency over output), then greedy argmax or temperature, top-k,
top-p, min-p and an exponential race. The processing is in `logits_processing`, each request's
state in `sampling_state`. What each row is drawn from (`min_p_logits`, `truncated_candidates`)
and the draws (`draw_plain`, `draw_candidates`) are public for the verification of speculative
proposals (`rejection_sampler`), which draws from the same distributions.

The race picks argmax(p_i / q_i) with q_i ~ Exp(1), which draws token i with probability p_i.
It runs in log space, argmax(logit_i / T - log q_i), so it needs no softmax and survives rows
whose logits are all -inf. Exp(1) comes as -log(U): torch's `exponential_` costs ~4x more on
CPU than `rand` + `log_`. A seeded request draws its uniforms from its own generator, one per
vocabulary entry keyed by token id, so its tokens depend on nothing else in the batch (not on
the batch's size, its order, or how wide a top-p candidate list turned out).

Everything is batched across rows. The only per-row Python loops are over seeded generators and
over the rows' logprobs on the way out.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from triode.wire.messages import Logprobs

from .logits_processing import needs_processing, process_logits
from .sampling_state import SamplingState

# top-p without top-k first looks for the nucleus among this many best tokens and only widens
# (x16 each time, up to a full sort) for rows whose candidates hold less than top_p of the mass:
# over a 49152 vocabulary one topk(256) costs ~1/8 of a full sort.
_FIRST_CANDIDATES = 256
_WIDEN = 16
# A topk wider than 1/_SORT_FROM of the vocabulary costs as much as a full sort.
_SORT_FROM = 4


@dataclass
class SamplerOutput:
    """One entry per row of the batch, in row order."""

    token_ids: list[int]
    # A one-position Logprobs for rows whose request asked for logprobs, else None.
    logprobs: list[Logprobs | None]


class Sampler:
    """Samples one token per row. Stateless: all per-request state lives in SamplingState."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample from `logits` [B, V] (any float dtype, any device), row i for `states[i]`.

        `logits` is never modified. Does not append the tokens to the states: the runner does,
        once it knows the request goes on.
        """
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(states)} states")
        # Tensors made along the way belong on the logits' device. The device mode costs a
        # little on every torch call, so CPU, the default device, goes without it.
        on_device = logits.device if logits.device.type != "cpu" else contextlib.nullcontext()
        with on_device:
            return self._sample(logits, states)

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        n = logits.shape[0]
        x = logits.float()
        # Logprobs are of the raw distribution: take them before anything touches x.
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(_take(x, lp_rows), dim=-1) if lp_rows else None

        if any(needs_processing(s) for s in states):
            owned = x is not logits and x.is_contiguous()
            x = process_logits(
                x if owned else x.clone(memory_format=torch.contiguous_format), states
            )

        tokens = torch.empty(n, dtype=torch.int64)
        greedy = [i for i, s in enumerate(states) if s.greedy]
        truncated = [i for i, s in enumerate(states) if s.truncates]
        plain = [i for i, s in enumerate(states) if not s.greedy and not s.truncates]
        if greedy:
            tokens = _merge(tokens, greedy, _argmax(_take(x, greedy)))
        if plain:
            sampled = _sample_plain(_take(x, plain), [states[i] for i in plain])
            tokens = _merge(tokens, plain, sampled)
        if truncated:
            sampled = _sample_truncated(_take(x, truncated), [states[i] for i in truncated])
            tokens = _merge(tokens, truncated, sampled)

        logprobs: list[Logprobs | None] = [None] * n
        if raw_logprobs is not None:
            num_top = [states[i].params.logprobs or 0 for i in lp_rows]
            batch = _gather_logprobs(raw_logprobs, tokens[lp_rows], max(num_top))
            for j, (i, k) in enumerate(zip(lp_rows, num_top, strict=True)):
                logprobs[i] = Logprobs(
                    token_ids=np.ascontiguousarray(batch.token_ids[j : j + 1, : 1 + k]),
                    logprobs=np.ascontiguousarray(batch.logprobs[j : j + 1, : 1 + k]),
                    ranks=batch.ranks[j : j + 1].copy(),
                )
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)


def compute_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Logprobs of `target_ids` [n] under `logits` [n, V], plus the `num_top` best alternatives.

    The runner uses this for prompt logprobs too: row i's target is prompt token i + 1.
    """
    return _gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, num_top)


def _sample_plain(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, min-p and the race over the whole vocabulary."""
    return draw_plain(min_p_logits(logits, states), states)


def min_p_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """What the sampler draws from for rows that neither are greedy nor truncate: the logits,
    unscaled, with -inf below each row's min-p floor (`logits` itself when no row uses min-p).
    A row's distribution is their softmax at its temperature."""
    if not any(s.uses_min_p for s in states):
        return logits
    temperature = _column([s.params.temperature for s in states])
    # p_i >= min_p * p_max  <=>  logit_i / T >= max / T + log(min_p)
    floor = logits.amax(dim=-1, keepdim=True) + temperature * _column(
        [_log(s.params.min_p) for s in states]
    )
    return logits.masked_fill(logits < floor, -math.inf)


def draw_plain(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """One token per row from softmax(logits / T) by the race.

    argmax(logit / T - log q) is argmax(logit - T log q): one fused pass, no division.
    """
    temperature = _column([s.params.temperature for s in states])
    log_q = _log_exponentials(states, logits.shape[1], None)
    return _argmax(torch.addcmul(logits, log_q, -temperature))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first on ties like `argmax`: `max`'s indices are computed by a
    vectorised kernel, 2.6x faster than `argmax`'s over a 49k vocabulary on the CPU."""
    return torch.max(x, dim=-1).indices


def _sample_truncated(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and the race over each row's surviving candidates."""
    values, ids = truncated_candidates(logits, states)
    return draw_candidates(values, ids, states, logits.shape[1])


def truncated_candidates(
    logits: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sampler draws from for rows that truncate (top-k or top-p, not greedy): each
    row's candidates as temperature-scaled log-weights (descending, -inf outside top-k, top-p
    and min-p) and their token ids, both [n, w]."""
    values, ids = _candidates(logits, states)
    if any(s.uses_min_p for s in states):
        floor = values[:, :1] + _column([_log(s.params.min_p) for s in states])
        values = values.masked_fill(values < floor, -math.inf)
    return values, ids


def draw_candidates(
    values: torch.Tensor, ids: torch.Tensor, states: list[SamplingState], vocab: int
) -> torch.Tensor:
    """One token per row from softmax(values) over the candidates `ids`, by the race."""
    scores = values - _log_exponentials(states, vocab, ids)
    return ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)


def _candidates(logits: torch.Tensor, states: list[SamplingState]) -> tuple[torch.Tensor, ...]:
    """Each row's top-k, then top-p, survivors: temperature-scaled values (descending, -inf
    padded) and their token ids.

    Ranking needs no temperature, so only the candidates get scaled. Rows needing a nucleus
    without top-k start from `_FIRST_CANDIDATES` best tokens; a row whose candidates hold less
    than top_p of the mass retries wider, alone, or sorted whole when no wider list can hold
    top_p: each token past the candidates is at most as likely as the last of them.
    """
    n, vocab = logits.shape
    top_k = torch.tensor([s.top_k for s in states])
    top_p = torch.tensor([s.params.top_p for s in states], dtype=torch.float32)
    inverse_t = _column([1.0 / s.params.temperature for s in states])
    unbounded = top_k == 0  # these rows need the mass of the whole row to find the nucleus
    log_mass: torch.Tensor | None = None

    width = int(top_k.max())
    if unbounded.any():
        width = max(width, _FIRST_CANDIDATES)
    width = min(width, vocab)
    pending = torch.arange(n)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    while len(pending):
        sub = _take(logits, pending)
        if width * _SORT_FROM >= vocab:
            values, ids = _sort_descending(sub)
        else:
            values, ids = sub.topk(width, dim=-1)
        values.mul_(_take(inverse_t, pending))
        if log_mass is None:  # the first pass, over every row: its values hold each row's max
            log_mass = torch.zeros(n)
            rows = unbounded.nonzero().squeeze(1)
            if len(rows):
                log_mass[rows] = _scaled_logsumexp(
                    _take(logits, rows), _take(values, rows)[:, :1], _take(inverse_t, rows)
                )
        p = top_p[pending]
        keep, mass, last = _nucleus(values, top_k[pending], p, log_mass[pending])
        # A whole row has nothing left to widen to, whatever rounding says.
        covered = (mass >= p) | (values.shape[1] == vocab)
        done = covered.nonzero().squeeze(1)
        if len(done):
            values = _take(values, done).masked_fill_(~_take(keep, done), -math.inf)
            found.append((_take(pending, done), values, _take(ids, done)))
        wider = min(vocab, width * _WIDEN)
        if not bool((mass + (wider - width) * last >= p)[~covered].any()):
            wider = vocab
        pending, width = pending[~covered], wider

    # Keep only the widest surviving prefix, so the race draws over as few columns as possible.
    kept = max(1, *(int((v > -math.inf).sum(dim=-1).max()) for _, v, _ in found))
    if len(found) == 1:  # one pass finished every row, so they are in order
        _, values, ids = found[0]
        return values[:, :kept], ids[:, :kept]
    values = torch.full((n, kept), -math.inf)
    ids = torch.zeros((n, kept), dtype=torch.int64)
    for rows, v, i in found:
        w = min(kept, v.shape[1])
        values[rows, :w] = v[:, :w]
        ids[rows, :w] = i[:, :w]
    return values, ids


def _nucleus(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which of the descending `values` survive top-k then top-p; the candidates' share of the
    row's probability mass; the probability of the last candidate.

    A token survives top-p when the mass strictly before it is below top_p (vLLM's rule; the
    first token always survives). Top-p renormalizes over the top-k set, so a row with top-k
    holds its whole distribution (share 1); a row without it (top_k 0) needs `log_mass`, the
    log-sum-exp of its full row, and its answer is final only if the share reaches top_p.
    """
    width = values.shape[1]
    unbounded = top_k == 0
    keep = torch.arange(width) < torch.where(unbounded, width, top_k).unsqueeze(1)
    if bool((top_p >= 1.0).all()):  # top-k alone, so no row is unbounded
        return keep, torch.ones(len(values)), torch.zeros(len(values))
    best = values[:, :1]
    weights = (values.masked_fill(~keep, -math.inf) - best).exp_()
    total = torch.where(unbounded, (log_mass - best.squeeze(1)).exp(), weights.sum(dim=-1))
    probs = weights.div_(total.unsqueeze(1))
    cumulative = probs.cumsum(dim=-1)
    keep &= (cumulative - probs < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    mass = torch.where(unbounded, cumulative[:, -1], 1.0)
    return keep, mass, torch.where(unbounded, probs[:, -1], 0.0)


def _sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise descending sort; on CPU through numpy, whose vectorized argsort is ~5x faster
    than torch.sort."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True)
    ids = torch.from_numpy(np.argsort(-x.numpy(), axis=-1))
    return x.gather(1, ids), ids


def _scaled_logsumexp(x: torch.Tensor, top: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of x * scale, given each row's max `top` of x * scale ([n, 1]).

    Three passes (fused scale-and-shift, exp, sum); torch.logsumexp(x * scale) takes several
    times as long on CPU for wide rows.
    """
    shift = (-top).clamp_(max=torch.finfo(x.dtype).max)
    return torch.addcmul(shift, x, scale).exp_().sum(dim=-1).log_() - shift.squeeze(1)


def _log_exponentials(
    states: list[SamplingState], vocab: int, ids: torch.Tensor | None
) -> torch.Tensor:
    """log q for the race, q ~ Exp(1): one per token (`ids` None) or per candidate in `ids`.

    Seeded rows draw a full vocabulary of uniforms from their (CPU) generator and index it by
    token id, so what they draw never depends on the candidate list's width or order.
    """
    shape = (len(states), vocab if ids is None else ids.shape[1])
    u = torch.rand(shape)
    for j, s in enumerate(states):
        if s.generator is not None:
            own = torch.rand(vocab, generator=s.generator, device="cpu").to(u.device)
            u[j] = own if ids is None else own[ids[j]]
    return u.log_().neg_().log_()


def _gather_logprobs(logprobs: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Column 0 the target, then the `num_top` best in descending order; rank as in vLLM
    (tokens at least as likely as the target, so 1 = the most likely)."""
    target_ids = target_ids.to(torch.int64)
    num_top = min(num_top, logprobs.shape[1])
    chosen = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    token_ids, values = target_ids.unsqueeze(1), chosen
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    return Logprobs(
        token_ids=token_ids.to(torch.int32).cpu().numpy(),
        logprobs=values.cpu().numpy(),
        ranks=ranks.to(torch.int32).cpu().numpy(),
    )


def plain_greedy(states: list[SamplingState]) -> bool:
    """Whether every row takes its argmax and reports nothing else: no logprobs, and nothing
    that changes the logits first."""
    return all(s.greedy and s.params.logprobs is None and not needs_processing(s) for s in states)


def _take(x: torch.Tensor, rows: list[int] | torch.Tensor) -> torch.Tensor:
    """x's `rows` (in increasing order): x itself when they are all of them, else a copy."""
    if len(rows) == x.shape[0]:
        return x
    return x[rows if isinstance(rows, torch.Tensor) else torch.tensor(rows)]


def _merge(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """x with its `rows` set to `values`: `values` itself when they are all of them."""
    if len(rows) == x.shape[0]:
        return values
    x[torch.tensor(rows)] = values
    return x


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf
