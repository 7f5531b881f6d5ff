"""The scheduler with speculative decoding, driven by a fake runner that verifies proposals.

The fake runner (`test_scheduler.FakeRunner`'s paged CRC "KV cache") writes every scheduled
token's slot, proposals included, and accepts proposals while they equal the fake model's
own next token. A proposal the scheduler failed to take back (a stale slot read later, a block
registered in the prefix cache over a rejected proposal) changes the CRC chain and with it
every later token, so each test compares the output against `reference`, which knows nothing
of speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pytest
from test_scheduler import VOCAB, FakeRunner, Harness, prompt_of, reference

from triode.actors.core.request import Request
from triode.actors.core.speculation import drafter as drafter_module
from triode.actors.core.speculation.config import SpeculativeConfig
from triode.actors.core.speculation.drafter import PROBE, Drafter, StepCost
from triode.wire import (
    FinishReason,
    ModelRunnerOutput,
    RequestStepResult,
    SamplingParams,
    SchedulerOutput,
)


class VerifyingRunner(FakeRunner):
    """`FakeRunner` that verifies a speculating request's proposals greedily: the rows of its
    last known token and of each proposal, read back through the block table."""

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        plain = super().__call__(out)
        by_id = {r.request_id: r for r in out.requests}
        results = []
        for result in plain.results:
            r = by_id[result.request_id]
            if r.num_draft_tokens and result.token_id is not None:
                end = r.num_computed_tokens + len(r.token_ids)
                first_row = end - r.num_draft_tokens - 1
                drafts = r.token_ids[len(r.token_ids) - r.num_draft_tokens :]
                accepted: list[int] = []
                for j in range(r.num_draft_tokens + 1):
                    own = self.model(self._read(r.block_ids, first_row + j)[1])
                    if j == r.num_draft_tokens or drafts[j] != own:
                        break
                    accepted.append(own)
                result = RequestStepResult(r.request_id, own, accepted_token_ids=accepted)
            results.append(result)
        return ModelRunnerOutput(out.step, results)


class OracleProposer:
    """Proposes each request's true continuation (`reference`), spoiled where `wrong`
    says: wrong(output index of the proposal) -> True makes that proposal a wrong token."""

    def __init__(self, truth: dict[str, list[int]], wrong: Callable[[int], bool]) -> None:
        self.truth, self.wrong = truth, wrong
        self.done: dict[str, int] = {}
        self.proposed = 0

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.done[request_id] = 0

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.done[request_id] += len(token_ids)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        n = self.done[request_id]
        out = self.truth[request_id][n : n + max_tokens]
        self.proposed += len(out)
        return [(t + 1) % VOCAB if self.wrong(n + i) else t for i, t in enumerate(out)]

    def stop(self, request_id: str) -> None:
        self.done.pop(request_id, None)


def speculating(
    prompts: dict[str, list[int]],
    max_tokens: int,
    wrong: Callable[[int], bool],
    k: int = 4,
    max_verify_rows: int | None = None,
    slope: float = 0.0,
    **config: object,
) -> tuple[Harness, OracleProposer]:
    h = Harness(**config)  # type: ignore[arg-type]
    h.runner = VerifyingRunner(h.config.block_size)
    truth = {rid: reference(p, max_tokens + k) for rid, p in prompts.items()}
    proposer = OracleProposer(truth, wrong)
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, max_verify_rows=max_verify_rows
    )
    h.sched.drafter = Drafter(spec, proposer, slope=slope)
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=max_tokens)
    return h, proposer


def tokens_of(h: Harness, rid: str) -> list[int]:
    return [t for o in h.outputs[rid] for t in o.new_token_ids]


@pytest.mark.parametrize(
    "wrong",
    [
        lambda i: False,  # every proposal accepted
        lambda i: True,  # every proposal rejected
        lambda i: i % 3 == 2,  # runs of two, then a rejection
        lambda i: i % 7 in (1, 4),
    ],
    ids=["all-right", "all-wrong", "every-third-wrong", "mixed"],
)
def test_speculating_output_is_the_reference_and_frees_every_block(wrong) -> None:
    prompts = {f"r{i}": prompt_of(i, 5 + 3 * i) for i in range(4)}
    h, _ = speculating(prompts, 30, wrong)
    h.run()
    for rid, prompt in prompts.items():
        assert tokens_of(h, rid) == reference(prompt, 30)
        assert h.outputs[rid][-1].finish_reason is FinishReason.LENGTH
    assert any(r.num_draft_tokens for out in h.schedules for r in out.requests)
    drafter = h.sched.drafter
    assert drafter is not None and drafter.num_draft_tokens > 0
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks  # rejected slots too


def test_accepted_proposals_save_steps() -> None:
    prompts = {"a": prompt_of(3, 6)}
    plain = Harness()
    plain.add("a", prompts["a"], max_tokens=40)
    plain.run()
    h, _ = speculating(prompts, 40, lambda i: False)
    h.run()
    assert tokens_of(h, "a") == tokens_of(plain, "a")
    # four proposals and the model's own token a step: 40 tokens in 8 decode steps, not 40
    assert len(h.schedules) <= len(plain.schedules) // 4
    drafter = h.sched.drafter
    assert drafter is not None and drafter.num_accepted_tokens == drafter.num_draft_tokens
    per_pos = drafter.num_accepted_tokens_per_pos
    assert per_pos[0] == drafter.num_drafts and sum(per_pos) == drafter.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)


def test_blocks_cached_after_rejections_hold_the_true_tokens() -> None:
    """A second request whose prompt is the first one's prompt and output hits the first's
    blocks in the prefix cache; any slot left from a rejected proposal would change its
    output."""
    prompt = prompt_of(5, 7)
    h, proposer = speculating({"a": prompt}, 29, lambda i: i % 2 == 1, k=3)
    h.run()
    out = tokens_of(h, "a")
    assert out == reference(prompt, 29)
    proposer.truth["b"] = reference(prompt + out, 20)
    h.add("b", prompt + out, max_tokens=12)
    h.run()
    assert tokens_of(h, "b") == reference(prompt + out, 12)
    assert h.outputs["b"][0].num_cached_tokens >= 32  # it did hit those blocks


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there() -> None:
    prompt = prompt_of(9, 6)
    truth = reference(prompt, 20)
    h, _ = speculating({}, 20, lambda i: False)
    h.sched.drafter.proposer.truth["s"] = truth  # type: ignore[union-attr]
    # the fourth token stops it, the first step after the prompt proposing all of it
    h.add("s", prompt, max_tokens=20, eos_token_id=truth[3])
    h.run()
    assert tokens_of(h, "s") == truth[:4]
    assert h.outputs["s"][-1].finish_reason is FinishReason.STOP
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks


def test_proposals_stop_at_max_tokens_and_the_context() -> None:
    h, _ = speculating({"m": prompt_of(1, 5)}, 6, lambda i: False, k=8, max_model_len=16)
    h.run()
    assert tokens_of(h, "m") == reference(prompt_of(1, 5), 6)
    for out in h.schedules:
        for r in out.requests:
            # never a row past the sixth output token nor past the context
            assert r.num_computed_tokens + len(r.token_ids) <= 5 + 6
    h2, _ = speculating({"c": prompt_of(2, 10)}, 40, lambda i: False, k=8, max_model_len=16)
    h2.run()
    assert tokens_of(h2, "c") == reference(prompt_of(2, 10), 6)  # the context ends it
    ends = [r.num_computed_tokens + len(r.token_ids) for o in h2.schedules for r in o.requests]
    assert max(ends) <= 16


def test_proposals_never_preempt_and_fit_the_row_budget() -> None:
    prompts = {f"p{i}": prompt_of(i, 8) for i in range(4)}
    # 4 requests of 8 prompt tokens and 20 outputs in blocks of 4: 7 blocks each at the end,
    # 28 of 30: proposals find no room near the end
    h, _ = speculating(prompts, 20, lambda i: False, k=4, max_verify_rows=6, num_blocks=30)
    h.run()
    for rid, prompt in prompts.items():
        assert tokens_of(h, rid) == reference(prompt, 20)
    assert h.sched.num_preemptions == 0
    for out in h.schedules:
        proposals = sum(r.num_draft_tokens for r in out.requests)
        decodes = sum(1 for r in out.requests if len(r.token_ids) - r.num_draft_tokens == 1)
        if proposals:
            assert decodes + proposals <= 6


def test_a_request_whose_proposals_fail_stops_proposing_then_tries_again() -> None:
    h, _ = speculating({"w": prompt_of(4, 5)}, 60, lambda i: True, k=4)
    h.run()
    assert tokens_of(h, "w") == reference(prompt_of(4, 5), 60)
    steps_with = sum(1 for o in h.schedules if any(r.num_draft_tokens for r in o.requests))
    # it backs off after its first failures, and comes back now and then
    assert 2 <= steps_with <= len(h.schedules) // 3


def test_preempted_speculating_requests_resume_with_the_reference_output() -> None:
    """A cache too small for all of them: requests are preempted mid-output (their
    proposals with them) and recompute; each output is still the reference."""
    prompts = {f"q{i}": prompt_of(20 + i, 9) for i in range(4)}
    h, _ = speculating(prompts, 24, lambda i: i % 4 == 3, k=3, num_blocks=22)
    h.run()
    assert h.sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert tokens_of(h, rid) == reference(prompt, 24)
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks


def test_an_aborted_speculating_request_frees_its_blocks_and_its_proposer_state() -> None:
    h, proposer = speculating({"x": prompt_of(6, 6), "y": prompt_of(7, 6)}, 30, lambda i: False)
    for _ in range(3):
        h.step()
    assert proposer.done.keys() == {"x", "y"}
    h.sched.abort_requests(["x"])
    assert "x" not in proposer.done
    h.run()
    assert tokens_of(h, "y") == reference(prompt_of(7, 6), 30)
    assert not proposer.done
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks


def _decoding(n: int) -> list[Request]:
    """n requests past their prompt, each with one output token whose K/V is not computed."""
    requests = []
    for i in range(n):
        req = Request(f"d{i}", prompt_of(i, 6), SamplingParams(max_tokens=100))
        req.append_output_token(1)
        req.num_computed_tokens = req.num_tokens - 1
        requests.append(req)
    return requests


class _Always:
    """Proposes four tokens for anyone."""

    def start(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...
    def extend(self, request_id: str, token_ids: Sequence[int]) -> None: ...
    def stop(self, request_id: str) -> None: ...
    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        return [5, 6, 7, 8][:max_tokens]


def test_the_cost_model_keeps_proposals_that_pay_and_fades_them_out_as_the_batch_grows() -> None:
    """With a step of r rows costing 1 + 0.07 (r - 1): one fresh request (worth 0.5, 0.25,
    then below MIN_WORTH) verifies two proposals. 24 fresh ones only probe (PROBE each: the
    step would verify none of theirs, a row costing them more than half a token's worth);
    once their probes failed, none; 12 whose proposals were all accepted lately verify some."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    drafter = Drafter(spec, _Always(), slope=0.07)
    assert {k: len(v) for k, v in drafter.plan(_decoding(1), 1000).items()} == {"d0": 2}
    crowd = _decoding(24)
    assert {len(v) for v in drafter.plan(crowd, 1000).values()} == {PROBE}
    for req in crowd:
        drafter.verified(req, PROBE, 0)
    assert drafter.plan(crowd, 1000) == {}
    for req in crowd[:12]:
        for _ in range(4):
            drafter.verified(req, 4, 4)
    planned = drafter.plan(crowd[:12], 1000)
    assert planned and sum(map(len, planned.values())) < 12 * 4
    with_cap = Drafter(
        SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_verify_rows=3),
        _Always(),
        slope=0.0,
    )
    assert sum(map(len, with_cap.plan(_decoding(1), 1000).values())) == 2  # 1 decode + 2


def test_the_acceptance_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drafter_module, "LOG_INTERVAL", 0.0)
    h, _ = speculating({"l": prompt_of(8, 6)}, 10, lambda i: i % 4 == 3, k=4)
    with caplog.at_level(logging.INFO, logger=drafter_module.__name__):
        h.run()
    lines = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert lines and "mean acceptance length" in lines[0] and "acceptance rate" in lines[0]


def test_the_step_cost_is_fitted_to_the_steps_timed() -> None:
    cost = StepCost(slope=0.07)
    assert cost.relative(11) == pytest.approx(1.7)  # the CPU family's slope, nothing timed
    for _ in range(20):
        cost.observe(8, 0.18)
    assert cost.fit() is None  # steps all alike: no slope in them
    for rows in [8, 12, 16, 24, 9, 13] * 4:
        cost.observe(rows, 0.1 + 0.01 * rows)
    a, b = cost.fit()  # type: ignore[misc]
    assert (a, b) == (pytest.approx(0.1, rel=0.05), pytest.approx(0.01, rel=0.05))
    assert cost.relative(11) == pytest.approx(0.21 / 0.11, rel=0.05)


def test_steps_timed_dearer_than_the_prior_stop_the_proposals_it_would_make() -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    drafter = Drafter(spec, _Always(), slope=0.0)  # rows free, by the prior
    assert drafter.plan(_decoding(1), 1000)
    for rows in [1, 2, 3, 5] * 5:  # but a row costs what a whole step of one did
        drafter.observe(rows, 0.01 + 0.1 * rows)
    assert drafter.plan(_decoding(1), 1000) == {}


def test_a_runner_claiming_more_accepted_than_proposed_is_held_to_the_proposals() -> None:
    class Boastful(VerifyingRunner):
        def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
            verified = super().__call__(out)
            for result in verified.results:
                result.accepted_token_ids = [*result.accepted_token_ids, 1, 2, 3, 4, 5, 6]
            return verified

    h, _ = speculating({"b": prompt_of(3, 6)}, 30, lambda i: i % 3 == 1, k=2)
    h.runner = Boastful(h.config.block_size)
    h.run()
    # a step emits at most its proposals and one token, so each after the prompt's computes
    # the last token and at most two proposals
    assert all(len(o.new_token_ids) <= 3 for o in h.outputs["b"])
    assert all(len(r.token_ids) <= 3 for o in h.schedules[1:] for r in o.requests)
    assert any(r.num_draft_tokens for o in h.schedules for r in o.requests)
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks
