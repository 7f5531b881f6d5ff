"""Which running requests propose how many tokens in a step (`Drafter.plan`), and what their
verification showed (`Drafter.verified`).

A step reads every weight once whatever its row count, but each row adds arithmetic: a step of
r rows takes about a + b * r seconds. The engine core times its decode steps (`observe`) and
`StepCost` fits a and b over the recent ones, so the cost of a row is this machine's, with its
model, its overheads and its load; until the fit has seen steps of different sizes, a step of r
rows is taken to cost 1 + slope * (r - 1) steps of one (`row_cost_slope`, by CPU family). A
request's j-th proposal is accepted with about its recent per-token acceptance rate
to the j-th power: that is its worth in tokens. `plan` takes the proposals worth most, as many
as make the step's tokens per unit of time (its decodes plus the proposals' worth, over its
cost) greatest: at one stream a proposal pays from a few percent of acceptance, at a large
batch the step is already arithmetic-bound and only near-certain proposals pay, so
speculation fades out on its own as the batch grows; a step whose best promises less than
`MARGIN` more tokens per second verifies none, but for `PROBE` proposals of each request
whose acceptance is unmeasured. A proposal worth less than `MIN_WORTH` tokens is
not made at all. A request
whose rate falls below that pauses its proposals for `FIRST_PAUSE` steps, twice as many each
time it falls again (up to `MAX_PAUSE`), then tries afresh: what it copies may change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..request import Request
from .config import SpeculativeConfig
from .proposer import Proposer, make_proposer

if TYPE_CHECKING:
    from triode.wire import SchedulerOutput

log = logging.getLogger(__name__)

# a proposal expected to be accepted less often than this is not worth its row
MIN_WORTH = 0.2
# a step verifies proposals only where they promise this much more tokens per second: at 32
# streams of the bench's chat load (acceptance ~0.7) a 10% margin still let proposals through
# whose steps ran ~5% slower per token than without, the cost model being that far off there
MARGIN = 0.2
# a request whose acceptance nothing has measured yet (new, or back from a pause) verifies this
# many proposals where the step would verify none: the prior alone would never let a busy
# step try, and so never learn that a request copies
PROBE = 2
# how much of a request's acceptance history each verification keeps: about the last 5 count
DECAY = 0.8
# the steps a request whose proposals fail pauses proposing for, the first time and at most
FIRST_PAUSE = 8
MAX_PAUSE = 128
# how often the acceptance log line may come
LOG_INTERVAL = 10.0


def row_cost_slope(cpuinfo: str | None = None) -> float:
    """What one more row adds to a decode step, in steps of one row, on this CPU.

    Measured with `triode bench step` on SmolLM2 (float32, a 2-core AVX2 EPYC): 1, 2, 5, 8, 16
    and 32 rows took 103, 111, 129, 149, 219 and 339 ms, about 1 + 0.07 (r - 1). CPUs with
    bfloat16 units (AVX512-BF16, AMX) run the model in bfloat16 with several times the
    arithmetic per byte read, so a row costs them less."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set(cpuinfo.split())
    if "amx_bf16" in flags:
        return 0.01
    if "avx512_bf16" in flags:
        return 0.03
    return 0.07


class StepCost:
    """What a step of r rows costs, in steps of one row: fitted as a + b * r seconds over the
    recent decode steps (least squares, each step's weight decaying by `FORGET` a step), or
    from the CPU family's slope while the recent steps' row counts are too alike to fit."""

    FORGET = 0.99  # about the last hundred steps count
    MIN_WEIGHT = 8.0  # steps before a fit
    MIN_SPREAD = 1.0  # the variance of their row counts, in rows squared

    def __init__(self, slope: float) -> None:
        self.slope = slope
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows * seconds

    def observe(self, rows: int, seconds: float) -> None:
        sums = self._sums
        for i in range(5):
            sums[i] *= self.FORGET
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            sums[i] += value

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of the recent steps, or None while they cannot tell."""
        w, x, y, xx, xy = self._sums
        if w < self.MIN_WEIGHT:
            return None
        spread = xx / w - (x / w) ** 2
        if spread < self.MIN_SPREAD:
            return None
        b = (xy / w - (x / w) * (y / w)) / spread
        a = y / w - b * x / w
        if b <= 0 or a + b <= 0:  # noise: more rows cannot cost less
            return None
        return a, b

    def relative(self, rows: int) -> float:
        """The fitted cost, never below the CPU family's: at 32 streams of the bench's chat
        load the fit alone let through proposals whose steps ran ~4% slower per token."""
        prior = 1.0 + self.slope * (rows - 1)
        fitted = self.fit()
        if fitted is None:
            return prior
        a, b = fitted
        return max(prior, (a + b * rows) / (a + b))


class _Track:
    """A request's recent acceptance: decayed counts of proposals accepted and tried, and
    the pause its failures earned."""

    __slots__ = ("accepted", "backoff", "pause", "tried")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.tried = 0.0
        self.pause = 0  # steps left without proposals
        self.backoff = FIRST_PAUSE  # the next pause

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` proposals accepted `num_accepted`: the positions
        after the first rejection were not tried."""
        self.accepted = self.accepted * DECAY + num_accepted
        self.tried = self.tried * DECAY + num_accepted + (num_accepted < num_drafts)
        if num_accepted:
            self.backoff = FIRST_PAUSE
        if self.rate < MIN_WORTH:
            self.pause, self.backoff = self.backoff, min(2 * self.backoff, MAX_PAUSE)
            self.accepted = self.tried = 0.0  # afresh once the pause is over

    @property
    def rate(self) -> float:
        """The per-proposal acceptance rate, with a prior of one accepted and one rejected."""
        return (self.accepted + 1.0) / (self.tried + 2.0)


class Drafter:
    """The engine core's speculation: its proposer, each request's acceptance, the counters
    vLLM's metrics are made of. Called by the scheduler from one thread."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        slope: float | None = None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.step_cost = StepCost(row_cost_slope() if slope is None else slope)
        self._tracks: dict[str, _Track] = {}
        # vLLM's counters: steps that verified proposals, proposals, accepted ones, and
        # accepted ones by position
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        self._logged_at = time.monotonic()
        self._logged = (0, 0, 0)

    def cost(self, rows: int) -> float:
        """What a step of `rows` rows costs, in steps of one row."""
        return self.step_cost.relative(rows)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows, decodes and proposals only, took `seconds`."""
        self.step_cost.observe(rows, seconds)

    def observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """A step took `seconds`, scheduling and publishing included: what the cost model of
        a row is fitted to, from steps of decodes (and proposals) only (prompt rows cost
        otherwise)."""
        requests = scheduled.requests
        if requests and all(len(r.token_ids) - r.num_draft_tokens <= 1 for r in requests):
            self.observe(scheduled.num_scheduled_tokens, seconds)

    def plan(self, running: Sequence[Request], max_len: int) -> dict[str, list[int]]:
        """Each running request's proposals for the next step (none for most): only requests
        whose last token is known and that are past their prompt propose, and only the
        proposals that make the step's tokens per unit of time greatest are kept."""
        rows = sum(max(0, r.num_tokens - r.num_computed_tokens) for r in running)
        ready = [
            r for r in running if r.num_computed_tokens == r.num_tokens - 1 and r.output_token_ids
        ]
        limit = self.config.disable_by_batch_size
        cap = self.config.max_verify_rows
        # a proposal sure to be accepted must beat the step's tokens per row to pay
        if (
            not ready
            or (limit is not None and len(running) > limit)
            or (cap is not None and rows >= cap)
            or (self.cost(rows + 1) - self.cost(rows)) * len(ready) / self.cost(rows)
            > 1 - MIN_WORTH
        ):
            return {}
        offers: list[tuple[float, int, str, int]] = []  # (-worth, order, request id, count)
        proposals: dict[str, list[int]] = {}
        probes: dict[str, list[int]] = {}  # of requests whose rate nothing has measured yet
        for order, req in enumerate(running):
            if req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids:
                continue
            track = self._track(req)
            room = self._room(req, max_len)
            if track.pause:
                track.pause -= 1
                continue
            if room <= 0:
                continue
            drafts = self.proposer.propose(req.request_id, room)
            if drafts and req.grammar is not None:
                drafts = drafts[: req.grammar.matcher.validate_tokens(drafts)]
            if not drafts:
                continue
            rate = track.rate
            proposals[req.request_id] = drafts
            if not track.tried:
                probes[req.request_id] = drafts[:PROBE]
            worth = 1.0
            for count in range(1, len(drafts) + 1):
                worth *= rate
                if worth < MIN_WORTH:
                    break
                offers.append((-worth, order, req.request_id, count))
        offers.sort()
        if cap is not None:
            del offers[max(0, cap - rows) :]
        # the number of best offers that makes (tokens) / (cost) greatest
        plain = len(ready) / self.cost(rows)
        best, best_rate, tokens = 0, plain, float(len(ready))
        for n, (negative_worth, *_) in enumerate(offers, 1):
            tokens -= negative_worth
            rate = tokens / self.cost(rows + n)
            if rate > best_rate:
                best, best_rate = n, rate
        if best_rate < plain * (1 + MARGIN):
            return probes
        planned: dict[str, list[int]] = {}
        for _, _, request_id, count in offers[:best]:
            taken = max(count, len(planned.get(request_id, ())))
            planned[request_id] = proposals[request_id][:taken]
        return planned

    def _room(self, req: Request, max_len: int) -> int:
        """The most proposals `req` may verify: at most k, none past the context, none past
        its max_tokens (the step emits one token after them)."""
        room = min(self.k, max_len - req.num_tokens - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        return room

    def _track(self, req: Request) -> _Track:
        track = self._tracks.get(req.request_id)
        if track is None:
            track = self._tracks[req.request_id] = _Track()
            # a prompt given as embeddings has placeholder ids: nothing to copy from there
            prompt = [] if req.prompt_embeds is not None else req.prompt_token_ids
            self.proposer.start(req.request_id, prompt)
            self.proposer.extend(req.request_id, req.output_token_ids)
        return track

    def extend(self, req: Request, token_ids: Sequence[int]) -> None:
        """Tokens were appended to `req`'s output."""
        if req.request_id in self._tracks:
            self.proposer.extend(req.request_id, token_ids)

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """`req`'s step verified `num_drafts` proposals and accepted the first
        `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1
        track = self._tracks.get(req.request_id)
        if track is not None:
            track.record(num_drafts, num_accepted)
        self._maybe_log()

    def stop(self, req: Request) -> None:
        """`req` left the engine (finished or aborted)."""
        if self._tracks.pop(req.request_id, None) is not None:
            self.proposer.stop(req.request_id)

    def stats(self) -> dict[str, int | list[int]]:
        """vLLM's speculative decoding counters, cumulative."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_INTERVAL:
            return
        drafts, tokens, accepted = (
            self.num_drafts - self._logged[0],
            self.num_draft_tokens - self._logged[1],
            self.num_accepted_tokens - self._logged[2],
        )
        self._logged_at, self._logged = (
            now,
            (
                self.num_drafts,
                self.num_draft_tokens,
                self.num_accepted_tokens,
            ),
        )
        if drafts:
            log.info(
                "speculative decoding: mean acceptance length %.2f, acceptance rate %.1f%% "
                "(%d accepted of %d proposed in %d verifications)",
                1 + accepted / drafts,
                100 * accepted / tokens,
                accepted,
                tokens,
                drafts,
            )
