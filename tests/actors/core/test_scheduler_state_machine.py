"""Random submit / abort / step traces against the scheduler's invariants.

Small caches, tiny budgets and prefix-sharing prompts make preemption, chunked prefill, prefix
hits and evictions common. After every rule the block accounting must balance exactly; every
output token must be what the fake model computes from the true sequence (so the KV blocks the
scheduler handed out held the right content); every request finishes exactly once, for the
reason the stop rules give; and once everything has run, every block is free again.

The fake runner comes from `test_scheduler` (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_scheduler import VOCAB, FakeRunner, next_token, prompt_of

from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    SchedulerOutput,
)

IDS = [f"r{i}" for i in range(6)]  # few ids, so that they are reused after finishing
SMALL_VOCAB = 32  # so that EOS and stop token ids come up often
BASES = [prompt_of(seed, 24) for seed in range(3)]  # shared prefixes


def reference_token(tokens: Sequence[int]) -> int:
    return next_token(tokens) % SMALL_VOCAB


def model(crc: int) -> int:
    return crc % VOCAB % SMALL_VOCAB


@dataclasses.dataclass(eq=False)
class Track:
    """What the test knows about one submitted request."""

    prompt: list[int]
    params: SamplingParams
    eos_token_id: int | None
    outputs: list[int] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None

    def expected_finish(self, max_len: int) -> FinishReason | None:
        """The stop rules, restated, for the last output token."""
        token, count, p = self.outputs[-1], len(self.outputs), self.params
        if count >= p.min_tokens and (
            (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids
        ):
            return FinishReason.STOP
        if p.max_tokens is not None and count >= p.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompt) + count >= max_len:
            return FinishReason.LENGTH
        return None


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 10),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 16),
        max_new_prompt_tokens=st.integers(0, 16),
        max_model_len=st.integers(2, 40),
        enable_prefix_caching=st.booleans(),
    )
    def setup(self, **config: int | bool) -> None:
        self.config = SchedulerConfig(**config)  # type: ignore[arg-type]
        self.sched = Scheduler(self.config)
        self.runner = FakeRunner(self.config.block_size, model=model)
        self.max_len = min(
            self.config.max_model_len, self.config.num_blocks * self.config.block_size
        )
        self.live: dict[str, Track] = {}
        self.tracks: list[Track] = []

    # Rules

    @rule(
        request_id=st.sampled_from(IDS),
        base=st.integers(0, len(BASES) - 1),
        length=st.integers(1, 30),
        shared=st.integers(0, 24),
        fits=st.integers(0, 9).map(bool),  # mostly fit the context, sometimes not
        borrowed_tail=st.booleans(),  # equal blocks behind different prefixes must not hit
        max_tokens=st.integers(1, 16) | st.none(),
        min_tokens=st.integers(0, 2),
        stop_token_ids=st.lists(st.integers(0, SMALL_VOCAB - 1), max_size=2),
        eos_token_id=st.integers(0, SMALL_VOCAB - 1) | st.none(),
        ignore_eos=st.booleans(),
        priority=st.integers(-1, 1),
        prompt_logprobs=st.sampled_from([None, None, None, 0]),
    )
    def submit(
        self,
        request_id: str,
        base: int,
        length: int,
        shared: int,
        fits: bool,
        borrowed_tail: bool,
        max_tokens: int | None,
        min_tokens: int,
        stop_token_ids: list[int],
        eos_token_id: int | None,
        ignore_eos: bool,
        priority: int,
        prompt_logprobs: int | None,
    ) -> None:
        if fits and self.max_len > 1:
            length = 1 + (length - 1) % (self.max_len - 1)
        shared = min(shared, length)
        tail = (
            BASES[(base + 1) % len(BASES)][: length - shared]
            if borrowed_tail
            else prompt_of(len(self.tracks) + 100, length - shared)
        )
        prompt = BASES[base][:shared] + tail
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            prompt_logprobs=prompt_logprobs,
        )
        request = EngineCoreRequest(
            request_id, prompt, params, eos_token_id=eos_token_id, priority=priority
        )
        error = self.sched.add_request(request)
        if request_id in self.live or len(prompt) >= self.max_len:
            assert error is not None and error.finish_reason is FinishReason.ERROR
            return
        assert error is None
        self.live[request_id] = track = Track(prompt, params, eos_token_id)
        self.tracks.append(track)

    @rule(request_ids=st.lists(st.sampled_from([*IDS, "unknown"]), max_size=3))
    def abort(self, request_ids: list[str]) -> None:
        self.sched.abort_requests(request_ids)
        self._aborted(request_ids)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int = 1) -> None:
        for _ in range(steps):
            out, scheduled = self._schedule()
            self._update(out, scheduled)

    @rule(request_id=st.sampled_from(IDS), resubmit=st.booleans())
    def abort_while_the_step_runs(self, request_id: str, resubmit: bool) -> None:
        out, scheduled = self._schedule()
        self.sched.abort_requests([request_id])
        self._aborted([request_id])
        if resubmit:
            self.submit(request_id, 0, 8, 8, True, False, 2, 0, [], None, False, 0, None)
        self._update(out, scheduled)

    @rule()
    def reset_prefix_cache(self) -> None:
        in_use = self.sched.kv_cache.num_free_blocks < self.config.num_blocks
        assert self.sched.reset_prefix_cache() is not in_use

    # Invariants

    @invariant()
    def blocks_balance(self) -> None:
        kv = self.sched.kv_cache
        refs = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
        for block in kv.pool.blocks:
            assert block.ref_cnt == refs[block.block_id] >= 0
            assert (block.ref_cnt == 0) == (block.block_id in kv.pool.free_queue)
        hashed = [b for b in kv.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(kv.pool.cached)
        assert all(kv.pool.cached[b.block_hash] is b for b in hashed if b.block_hash)
        assert set(kv.req_blocks) <= {r.request_id for r in self.sched.running}

    @invariant()
    def queues_hold_exactly_the_live_requests(self) -> None:
        running, waiting = self.sched.running, self.sched.waiting
        assert len(running) <= self.config.max_num_seqs
        assert sorted(r.request_id for r in running + waiting) == sorted(self.live)
        assert running == sorted(running, key=lambda r: r.sort_key)
        assert waiting == sorted(waiting, key=lambda r: r.sort_key)
        assert all(r.num_computed_tokens == 0 for r in waiting)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert all(track.finish is not None for track in self.tracks)
        kv = self.sched.kv_cache
        assert kv.num_free_blocks == self.config.num_blocks and not kv.req_blocks
        # The last finished ids wait for the next step that has work.
        assert set(self.runner.known) == set(self.sched._runner_forget)
        assert not self.sched.schedule().finished_request_ids

    # Helpers

    def _schedule(self) -> tuple[SchedulerOutput, dict[str, Track]]:
        busy = self.sched.has_unfinished_requests()
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert not busy or out.requests, "live requests but nothing scheduled: a stall"
        scheduled = {r.request_id: self.live[r.request_id] for r in out.requests}
        assert len(scheduled) == len(out.requests), "a request scheduled twice in one step"
        for entry in out.requests:
            req = self.sched.requests[entry.request_id]
            end = entry.num_computed_tokens + len(entry.token_ids)
            assert entry.token_ids and req.num_computed_tokens == end <= self.max_len
            assert entry.sample == (end == req.num_tokens)
        return out, scheduled

    def _update(self, out: SchedulerOutput, scheduled: dict[str, Track]) -> None:
        per_client = self.sched.update_from_output(out, self.runner(out))
        for outputs in per_client.values():
            self._check_outputs(outputs, scheduled)

    def _check_outputs(self, outputs: EngineCoreOutputs, scheduled: dict[str, Track]) -> None:
        for output in outputs.outputs:
            track = self.live.get(output.request_id)
            assert track is not None and track is scheduled.get(output.request_id)
            for token in output.new_token_ids:
                assert token == reference_token(track.prompt + track.outputs)
                track.outputs.append(token)
            assert len(output.new_token_ids) <= 1
            if output.new_token_ids:
                assert output.finish_reason == track.expected_finish(self.max_len)
            if output.finish_reason is not None:
                track.finish = output.finish_reason
                del self.live[output.request_id]
                assert output.request_id in (outputs.finished_requests or [])

    def _aborted(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            track = self.live.pop(request_id, None)
            if track is not None:
                track.finish = FinishReason.ABORT


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
