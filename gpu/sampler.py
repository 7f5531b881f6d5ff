"""The sampler: next tokens (and their logprobs) from the last-position logits of a batch.

Semantics follow vLLM V1. Logprobs describe the raw model distribution. The logits are then
processed in this order: allowed_token_ids, logit_bias, min_tokens, penalties (repetition over
prompt + output, presence and frequency over output), then greedy argmax or temperature, top-k,
top-p, min-p and an exponential race.

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

from triode.wire.messages import Logprobs, SamplingParams

# Below this temperature a request is greedy: dividing by it would overflow float32 logits.
_GREEDY_TEMPERATURE = 1e-5

# top-p without top-k first looks for the nucleus among this many best tokens and only widens
# (x16 each time, up to a full sort) for rows whose candidates hold less than top_p of the mass:
# over a 49152 vocabulary one topk(256) costs ~1/8 of a full sort.
_FIRST_CANDIDATES = 256
_WIDEN = 16
# A topk wider than 1/_SORT_FROM of the vocabulary costs as much as a full sort.
_SORT_FROM = 4


class SamplingState:
    """One request's sampling state, kept by the model runner from first sight until it finishes.

    Everything that does not change between steps (allowed ids, biases, the ids min_tokens holds
    back, the prompt for the repetition penalty) becomes an array once here, not on every step;
    the allowed ids become a mask over the vocabulary, so a step costs the same however many
    of them a request names.
    Append each sampled token with `append`, never to `output_token_ids` directly: penalties
    read a numpy mirror of the output that `append` keeps.

    Raises ValueError when a token id in the parameters is outside the vocabulary.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_id: int | None,
        vocab_size: int,
    ) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.output_token_ids: list[int] = []
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

        # top_k == 1 keeps only the argmax, whatever the temperature: sample it as greedy. A
        # top_k that spans the vocabulary keeps everything: turn it off (0).
        self.top_k = params.top_k if params.top_k < vocab_size else 0
        self.greedy = params.temperature < _GREEDY_TEMPERATURE or self.top_k == 1
        self.truncates = not self.greedy and (self.top_k > 0 or params.top_p < 1.0)
        self.uses_min_p = not self.greedy and params.min_p > 0.0

        self.allowed_mask: torch.Tensor | None = None  # bool [vocab_size]
        if params.allowed_token_ids is not None:
            allowed = self._ids("allowed_token_ids", params.allowed_token_ids)
            self.allowed_mask = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
            self.allowed_mask[torch.from_numpy(allowed)] = True
        self.logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # ids, values
        if params.logit_bias:
            values = np.fromiter(params.logit_bias.values(), dtype=np.float32)
            self.logit_bias = (self._ids("logit_bias", list(params.logit_bias)), values)
        # min_tokens holds back every id that would stop the request, as vLLM does: the stop ids,
        # and EOS unless it is ignored. An id outside the vocabulary can never be sampled anyway.
        stop_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(eos_token_id)
        stop_ids = {t for t in stop_ids if t < vocab_size}
        self.min_tokens_ids: np.ndarray | None = None
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens_ids = np.array(sorted(stop_ids), dtype=np.int64)

        self.repetition = params.repetition_penalty != 1.0
        self.penalized = (
            self.repetition or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self.prompt_ids = np.asarray(prompt_token_ids, dtype=np.int64) if self.repetition else None
        self._outputs = np.empty(16 if self.penalized else 0, dtype=np.int64)

    def append(self, token_id: int) -> None:
        """Record a sampled token (the runner calls this once per step that sampled)."""
        if self.penalized:
            n = len(self.output_token_ids)
            if n == len(self._outputs):
                self._outputs = np.resize(self._outputs, 2 * n)
            self._outputs[n] = token_id
        self.output_token_ids.append(token_id)

    @property
    def output_ids(self) -> np.ndarray:
        """The output so far as int64 (a view: valid until the next `append`)."""
        return self._outputs[: len(self.output_token_ids)]

    def _ids(self, field: str, ids: list[int]) -> np.ndarray:
        if any(t >= self.vocab_size for t in ids):
            raise ValueError(f"{field}: token ids must be < vocabulary size {self.vocab_size}")
        return np.array(ids, dtype=np.int64)


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

        if any(_needs_processing(s) for s in states):
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


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Disallow, in place, the tokens a structured output's grammar does not allow next.

    Row j of `bitmask` (int32 [len(rows), ceil(V / 32)], bit t of word w allowing token
    32 w + t) constrains `logits[rows[j]]`; the runner applies it before sampling, so logprobs
    describe the constrained distribution, as in vLLM. On CPU float32 logits (where the runner
    samples) it works on the floats' bits, a fourth of `masked_fill_`'s time.
    """
    if len(rows) != len(bitmask):
        raise ValueError(f"{len(bitmask)} bitmask rows for {len(rows)} constrained rows")
    vocab = logits.shape[1]
    # little-endian words: byte k of row j holds tokens 8k..8k+7, lowest bit first
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    every_row = rows == list(range(len(logits)))
    index = None if every_row else torch.tensor(rows, device=logits.device)
    target = logits if index is None else logits[index]
    if target.device.type == "cpu" and target.dtype == torch.float32 and target.is_contiguous():
        _refuse_bits(target.numpy(), bits)
    else:
        refused = torch.from_numpy(bits).to(target.device) == 0
        target.masked_fill_(refused, -math.inf)
    if index is not None:
        logits[index] = target


_MINUS_INF_BITS = np.array(-np.inf, dtype=np.float32).view(np.int32)


def _refuse_bits(values: np.ndarray, allowed: np.ndarray) -> None:
    # -inf where `allowed` (0/1 bytes) is 0: value & keep | ~keep & bits(-inf), keep all ones
    # or all zeros
    as_ints = values.view(np.int32)
    keep = allowed.astype(np.int32)
    np.negative(keep, out=keep)
    np.bitwise_and(as_ints, keep, out=as_ints)
    np.invert(keep, out=keep)
    np.bitwise_and(keep, _MINUS_INF_BITS, out=keep)
    np.bitwise_or(as_ints, keep, out=as_ints)


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Apply allowed_token_ids, logit_bias, min_tokens and penalties to `logits`, in place.

    `logits` must be contiguous float32. Each stage touches only the rows that use it: the
    allowed ids through their rows' masks, the biases and min_tokens through one batched scatter
    over the concatenated per-row ids; penalties touch only the tokens that occurred. Returns
    `logits`.
    """
    allowed = [(i, s.allowed_mask) for i, s in enumerate(states) if s.allowed_mask is not None]
    if allowed:
        rows = torch.tensor([i for i, _ in allowed])
        keep = torch.stack([mask for _, mask in allowed]).to(logits.device)
        logits[rows] = logits[rows].masked_fill_(~keep, -math.inf)

    biased = [(i, s.logit_bias) for i, s in enumerate(states) if s.logit_bias is not None]
    if biased:
        values = torch.from_numpy(np.concatenate([bias for _, (_, bias) in biased]))
        values = values.to(logits.device)
        logits.index_put_(_pairs([(i, ids) for i, (ids, _) in biased]), values, accumulate=True)

    held = [
        (i, s.min_tokens_ids)
        for i, s in enumerate(states)
        if s.min_tokens_ids is not None and len(s.output_token_ids) < s.params.min_tokens
    ]
    if held:
        logits[_pairs(held)] = -math.inf

    penalized = [i for i, s in enumerate(states) if s.penalized]
    if penalized:
        _penalize(logits, penalized, [states[i] for i in penalized])
    return logits


def _penalize(logits: torch.Tensor, rows: list[int], states: list[SamplingState]) -> None:
    """Repetition (HF), presence and frequency (OpenAI) penalties, in place.

    Works on the (row, token) pairs that occurred, as flat indices `row * vocab + token`, so the
    cost follows the length of the histories rather than rows x vocabulary.
    """
    n, vocab = logits.shape
    flat = logits.view(-1)
    output = _flat(_pairs([(r, s.output_ids) for r, s in zip(rows, states, strict=True)]), vocab)
    if any(s.repetition for s in states):
        prompts = [(r, s.prompt_ids) for r, s in zip(rows, states, strict=True)]
        prompt = _flat(_pairs([(r, ids) for r, ids in prompts if ids is not None]), vocab)
        seen = torch.cat([prompt, output]).unique()
        penalty = _per_row(n, rows, [s.params.repetition_penalty for s in states], 1.0)
        values, penalty = flat[seen], penalty[seen // vocab]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)

    pairs, counts = output.unique(return_counts=True)
    row = pairs // vocab
    frequency = _per_row(n, rows, [s.params.frequency_penalty for s in states], 0.0)[row]
    presence = _per_row(n, rows, [s.params.presence_penalty for s in states], 0.0)[row]
    flat[pairs] -= counts * frequency + presence


def _sample_plain(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, min-p and the race over the whole vocabulary.

    argmax(logit / T - log q) is argmax(logit - T log q): one fused pass, no division.
    """
    temperature = _column([s.params.temperature for s in states])
    if any(s.uses_min_p for s in states):
        # p_i >= min_p * p_max  <=>  logit_i / T >= max / T + log(min_p)
        floor = logits.amax(dim=-1, keepdim=True) + temperature * _column(
            [_log(s.params.min_p) for s in states]
        )
        logits = logits.masked_fill(logits < floor, -math.inf)
    log_q = _log_exponentials(states, logits.shape[1], None)
    return _argmax(torch.addcmul(logits, log_q, -temperature))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first on ties like `argmax`: `max`'s indices are computed by a
    vectorised kernel, 2.6x faster than `argmax`'s over a 49k vocabulary on the CPU."""
    return torch.max(x, dim=-1).indices


def _sample_truncated(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and the race over each row's surviving candidates."""
    values, ids = _candidates(logits, states)
    if any(s.uses_min_p for s in states):
        floor = values[:, :1] + _column([_log(s.params.min_p) for s in states])
        values = values.masked_fill(values < floor, -math.inf)
    scores = values - _log_exponentials(states, logits.shape[1], ids)
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
    return all(s.greedy and s.params.logprobs is None and not _needs_processing(s) for s in states)


def _needs_processing(state: SamplingState) -> bool:
    return (
        state.allowed_mask is not None
        or state.logit_bias is not None
        or state.min_tokens_ids is not None
        or state.penalized
    )


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


def _pairs(rows_ids: list[tuple[int, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors (row of each id, id) for per-row id arrays, ready for advanced indexing."""
    lengths = [len(ids) for _, ids in rows_ids]
    rows = np.repeat(np.array([r for r, _ in rows_ids], dtype=np.int64), lengths)
    ids = np.concatenate([ids for _, ids in rows_ids])
    device = torch.get_default_device()
    return torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)


def _flat(index: tuple[torch.Tensor, torch.Tensor], vocab: int) -> torch.Tensor:
    rows, ids = index
    return rows * vocab + ids


def _per_row(n: int, rows: list[int], values: list[float], default: float) -> torch.Tensor:
    """A [n] tensor holding `values` at `rows` and `default` elsewhere."""
    out = torch.full((n,), default)
    out[rows] = torch.tensor(values)
    return out


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf
