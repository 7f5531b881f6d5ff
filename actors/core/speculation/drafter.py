"""Which running requests propose how many tokens in a step (`Drafter.plan`), and what their
verification showed (`Drafter.verified`).

On a CPU a decode step reads every weight once whatever its row count, up to the row count
where arithmetic starts to cost more than reading: rows below it ride almost free. A step's
proposals therefore share what is left of a row budget (`max_verify_rows`) after its decodes
and prompt rows, and none are made past it: at a large batch the step is already
arithmetic-bound, and verifying would only slow it. The spare rows go to the proposals worth
most: a request's j-th proposal is accepted with about its recent per-token acceptance rate to
the j-th power, and a proposal worth less than `MIN_WORTH` tokens is not made at all. A request
whose rate falls below that pauses its proposals for `FIRST_PAUSE` steps, twice as many each
time it falls again (up to `MAX_PAUSE`), then tries afresh: what it copies may change.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from ..request import Request
from .config import SpeculativeConfig
from .proposer import Proposer, make_proposer

log = logging.getLogger(__name__)

# a proposal expected to be accepted less often than this is not worth its row
MIN_WORTH = 0.2
# how much of a request's acceptance history each verification keeps: about the last 5 count
DECAY = 0.8
# the steps a request whose proposals fail pauses proposing for, the first time and at most
FIRST_PAUSE = 8
MAX_PAUSE = 128
# how often the acceptance log line may come
LOG_INTERVAL = 10.0


def default_verify_rows(cpuinfo: str | None = None) -> int:
    """The rows a step computes at about the cost of one on this CPU (`triode bench step`):
    with AVX2 alone float32 products turn arithmetic-bound from about 8 rows; AVX512 and AMX
    units take bfloat16 at several times that rate."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set(cpuinfo.split())
    if "amx_bf16" in flags:
        return 48
    if "avx512_bf16" in flags:
        return 24
    if "avx512f" in flags:
        return 16
    return 8


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
        max_verify_rows: int | None = None,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.max_verify_rows = max_verify_rows or config.max_verify_rows or default_verify_rows()
        self._tracks: dict[str, _Track] = {}
        # vLLM's counters: steps that verified proposals, proposals, accepted ones, and
        # accepted ones by position
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        self._logged_at = time.monotonic()
        self._logged = (0, 0, 0)

    def plan(self, running: Sequence[Request], max_len: int) -> dict[str, list[int]]:
        """Each running request's proposals for the next step (none for most), within the row
        budget: only requests whose last token is known and that are past their prompt."""
        rows = sum(max(0, r.num_tokens - r.num_computed_tokens) for r in running)
        spare = self.max_verify_rows - rows
        limit = self.config.disable_by_batch_size
        if spare <= 0 or (limit is not None and len(running) > limit):
            return {}
        offers: list[tuple[float, int, str, int]] = []  # (-worth, order, request id, count)
        proposals: dict[str, list[int]] = {}
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
            worth = 1.0
            for count in range(1, len(drafts) + 1):
                worth *= rate
                if worth < MIN_WORTH:
                    break
                offers.append((-worth, order, req.request_id, count))
        planned: dict[str, list[int]] = {}
        for _, _, request_id, count in heapq.nsmallest(spare, offers):
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
