"""The scheduler's policy, driven step by step with a fake model runner.

The fake runner keeps a paged "KV cache" whose slot for position p holds the token there and a
running CRC-32 of the whole sequence up to p, read from the slot of p-1 through the block table:
like real K/V, a slot's content depends on the entire prefix. It samples a function of the
last slot's CRC. So a wrong block table, a prefix-cache hit on a block computed behind another
prefix, or a block reused while still live changes the tokens, and every test can compare
against `reference`.
"""

from __future__ import annotations

import zlib
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from triode.actors.core.request import RequestStatus
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    RequestStepResult,
    SamplingParams,
    SchedulerOutput,
)

VOCAB = 1000


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: the next token is a function of the whole sequence so far."""
    return zlib.crc32(array("Q", tokens).tobytes()) % VOCAB


def _extend_crc(crc: int, token: int) -> int:
    return zlib.crc32(array("Q", [token]).tobytes(), crc)


def reference(prompt: Sequence[int], n: int) -> list[int]:
    """What a request generates without any scheduling in the way."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % VOCAB for i in range(n)]


class FakeRunner:
    """Plays the model runner's side of the step protocol and checks it on the way."""

    def __init__(
        self,
        block_size: int,
        script: dict[str, list[int]] | None = None,
        model: Callable[[int], int] = lambda crc: crc % VOCAB,
    ) -> None:
        self.block_size = block_size
        self.model = model  # the sequence's CRC-32 -> the next token, as in `next_token`
        self.slots: defaultdict[int, list[tuple[int, int] | None]] = defaultdict(
            lambda: [None] * block_size
        )
        self.known: dict[str, NewRequestData] = {}
        self.script = script or {}  # forced output tokens by output index

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            assert self.known.pop(request_id, None) is not None, "forget an unknown request"
        for r in out.requests:
            if r.new is not None:
                assert r.request_id not in self.known, "new data sent twice"
                self.known[r.request_id] = r.new
            assert r.request_id in self.known, "scheduled before the runner saw it"
            start = r.num_computed_tokens
            crc = self._read(r.block_ids, start - 1)[1] if start else 0
            for pos, token in enumerate(r.token_ids, start):
                crc = _extend_crc(crc, token)
                self.slots[r.block_ids[pos // self.block_size]][pos % self.block_size] = (
                    token,
                    crc,
                )
        results = []
        for r in out.requests:  # read only after every write, like a layer of a real forward
            end = r.num_computed_tokens + len(r.token_ids)
            tokens = [self._read(r.block_ids, p)[0] for p in range(end)]
            assert _extend_crc(0, tokens[0]) == self._read(r.block_ids, 0)[1]
            result = RequestStepResult(r.request_id)
            new = self.known[r.request_id]
            if new.sampling_params.prompt_logprobs is not None:
                result.prompt_logprobs = _prompt_rows(
                    new.prompt_token_ids, r.num_computed_tokens, end
                )
            if r.sample:
                index = end - len(new.prompt_token_ids)
                script = self.script.get(r.request_id, [])
                crc = self._read(r.block_ids, end - 1)[1]
                result.token_id = script[index] if index < len(script) else self.model(crc)
            if result.token_id is not None or result.prompt_logprobs is not None:
                results.append(result)
        return ModelRunnerOutput(out.step, results)

    def _read(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        slot = self.slots[block_ids[pos // self.block_size]][pos % self.block_size]
        assert slot is not None, f"position {pos} read before it was written"
        return slot


def _prompt_rows(prompt: list[int], start: int, end: int) -> Logprobs | None:
    """Rows for prompt tokens start+1 .. min(end, len(prompt) - 1)."""
    ids = prompt[start + 1 : min(end, len(prompt) - 1) + 1]
    if not ids:
        return None
    return Logprobs(
        np.array(ids, dtype=np.int32).reshape(-1, 1),
        np.zeros((len(ids), 1), dtype=np.float32),
        np.ones(len(ids), dtype=np.int32),
    )


class Harness:
    """A scheduler, a fake runner and a record of what each request was sent."""

    def __init__(self, script: dict[str, list[int]] | None = None, **config: Any) -> None:
        defaults: dict[str, Any] = dict(
            num_blocks=64,
            block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=128,
        )
        self.config = SchedulerConfig(**(defaults | config))
        self.sched = Scheduler(self.config)
        self.runner = FakeRunner(self.config.block_size, script)
        self.outputs: defaultdict[str, list[EngineCoreOutput]] = defaultdict(list)
        self.finished_requests: defaultdict[int, list[str]] = defaultdict(list)
        self.prompts: dict[str, list[int]] = {}
        self.schedules: list[SchedulerOutput] = []

    def add(
        self,
        request_id: str,
        prompt: list[int],
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        client_index: int = 0,
        cache_salt: str | None = None,
        **params: Any,
    ) -> EngineCoreOutput | None:
        self.prompts[request_id] = prompt
        request = EngineCoreRequest(
            request_id,
            prompt,
            SamplingParams(**params),
            eos_token_id=eos_token_id,
            priority=priority,
            client_index=client_index,
            cache_salt=cache_salt,
        )
        return self.sched.add_request(request)

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        self.schedules.append(out)
        return out

    def finish_step(self, out: SchedulerOutput) -> None:
        per_client = self.sched.update_from_output(out, self.runner(out))
        for client, outputs in per_client.items():
            for output in outputs.outputs:
                assert not self.finished(output.request_id), "output after the finish"
                self.outputs[output.request_id].append(output)
            self.finished_requests[client] += outputs.finished_requests or []

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.finish_step(out)
        return out

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for output in self.outputs[request_id] for t in output.new_token_ids]

    def finished(self, request_id: str) -> bool:
        outputs = self.outputs.get(request_id, [])
        return bool(outputs) and outputs[-1].finished

    def last(self, request_id: str) -> EngineCoreOutput:
        return self.outputs[request_id][-1]

    def entries(self, request_id: str) -> list[tuple[int, Any]]:
        """(step, ScheduledRequest) for every step that scheduled the request."""
        return [
            (o.step, r) for o in self.schedules for r in o.requests if r.request_id == request_id
        ]


# Chunked prefill and budgets


def test_chunked_prefill_splits_prompt_into_contiguous_chunks() -> None:
    h = Harness(max_num_batched_tokens=8)
    prompt = prompt_of(1, 20)
    h.add("a", prompt, max_tokens=3)
    h.run()
    entries = [r for _, r in h.entries("a")]
    assert [len(r.token_ids) for r in entries] == [8, 8, 4, 1, 1]
    assert [r.num_computed_tokens for r in entries] == [0, 8, 16, 20, 21]
    assert [r.sample for r in entries] == [False, False, True, True, True]
    assert [t for r in entries[:3] for t in r.token_ids] == prompt
    assert entries[0].new is not None and all(r.new is None for r in entries[1:])
    assert h.tokens("a") == reference(prompt, 3)


def test_running_requests_are_served_before_a_new_prompt_takes_the_rest() -> None:
    h = Harness(max_num_batched_tokens=6)
    h.add("a", prompt_of(1, 6), max_tokens=4)
    h.step()
    h.add("b", prompt_of(2, 12), max_tokens=2)
    out = h.step()
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 1), ("b", 5)]
    assert out.requests[1].sample is False
    h.run()
    assert h.tokens("b") == reference(prompt_of(2, 12), 2)


def test_a_step_starts_new_requests_with_at_most_max_new_prompt_tokens() -> None:
    h = Harness(max_num_batched_tokens=64, max_new_prompt_tokens=12)
    for i in range(5):  # a burst of 5 prompts of 5 tokens
        h.add(f"r{i}", prompt_of(i, 5), max_tokens=3)
    starts = [[r.request_id for r in h.step().requests if r.new is not None] for _ in range(3)]
    assert starts == [["r0", "r1"], ["r2", "r3"], ["r4"]]  # 10 tokens, not 15, a step
    h.run()
    assert all(h.tokens(f"r{i}") == reference(prompt_of(i, 5), 3) for i in range(5))


def test_the_first_new_request_takes_the_whole_budget_and_0_means_no_limit() -> None:
    h = Harness(max_num_batched_tokens=32, max_new_prompt_tokens=8)
    h.add("long", prompt_of(1, 40), max_tokens=2)
    h.add("short", prompt_of(2, 4), max_tokens=2)
    out = h.step()  # a lone long prompt is not chunked finer than the budget
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 32)]
    out = h.step()  # running requests are not limited: "long" goes on, then "short" starts
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 8), ("short", 4)]
    h.run()
    assert h.tokens("long") == reference(prompt_of(1, 40), 2)

    h = Harness(max_num_batched_tokens=64, max_new_prompt_tokens=0)
    for i in range(5):
        h.add(f"r{i}", prompt_of(i, 5), max_tokens=3)
    assert len(h.step().requests) == 5


def test_max_num_seqs_caps_running_requests() -> None:
    h = Harness(max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", prompt_of(i, 5), max_tokens=3)
    out = h.step()
    assert {r.request_id for r in out.requests} == {"r0", "r1"}
    while h.sched.has_unfinished_requests():
        out = h.step()
        assert len(out.requests) <= 2
    assert all(h.tokens(f"r{i}") == reference(prompt_of(i, 5), 3) for i in range(5))


def test_requests_are_served_first_come_first_served() -> None:
    h = Harness(max_num_seqs=1)
    for name in "cab":
        h.add(name, prompt_of(ord(name), 3), max_tokens=2)
    h.run()
    first_step = {name: h.entries(name)[0][0] for name in "cab"}
    assert first_step["c"] < first_step["a"] < first_step["b"]


def test_lower_priority_value_is_served_first_and_ties_keep_arrival_order() -> None:
    h = Harness(max_num_seqs=1)
    h.add("late-low", prompt_of(1, 3), max_tokens=1, priority=5)
    h.add("urgent", prompt_of(2, 3), max_tokens=1, priority=-1)
    h.add("normal-1", prompt_of(3, 3), max_tokens=1)
    h.add("normal-2", prompt_of(4, 3), max_tokens=1)
    h.run()
    order = sorted(h.prompts, key=lambda name: h.entries(name)[0][0])
    assert order == ["urgent", "normal-1", "normal-2", "late-low"]


# Preemption


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_the_newest_request_and_outputs_are_unchanged(
    prefix_caching: bool,
) -> None:
    h = Harness(num_blocks=6, enable_prefix_caching=prefix_caching)
    prompts = {name: prompt_of(i, 4) for i, name in enumerate("abc")}
    for name, prompt in prompts.items():
        h.add(name, prompt, max_tokens=10)
    while not h.sched.get_stats().num_preemptions:
        h.step()
    assert h.sched.requests["c"].status is RequestStatus.PREEMPTED
    assert {r.request_id for r in h.sched.running} == {"a", "b"}
    assert h.sched.kv_cache.block_ids("c") == []
    generated, preempted_at = h.tokens("c"), h.schedules[-1].step
    h.run()
    resume = next(r for step, r in h.entries("c") if step > preempted_at)
    assert resume.new is None, "a preempted request is not new to the runner"
    if not prefix_caching:
        assert resume.num_computed_tokens == 0
        assert resume.token_ids[: 4 + len(generated)] == prompts["c"] + generated
    for name, prompt in prompts.items():
        assert h.tokens(name) == reference(prompt, 10)
        assert h.last(name).finish_reason is FinishReason.LENGTH
    assert h.sched.get_stats().num_preemptions >= 1
    assert h.sched.kv_cache.num_free_blocks == 6


def test_preemption_picks_the_lowest_priority_request_not_the_newest() -> None:
    h = Harness(num_blocks=6, enable_prefix_caching=False)
    h.add("a", prompt_of(1, 4), max_tokens=10)
    h.add("background", prompt_of(2, 4), max_tokens=10, priority=1)
    h.add("c", prompt_of(3, 4), max_tokens=10)
    while not h.sched.get_stats().num_preemptions:
        h.step()
    assert h.sched.requests["background"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in h.sched.running] == ["a", "c"]
    h.run()
    assert h.tokens("background") == reference(prompt_of(2, 4), 10)


def test_request_longer_than_the_cache_stops_at_cache_capacity() -> None:
    h = Harness(num_blocks=3, block_size=4, max_model_len=100)
    h.add("a", prompt_of(1, 4), max_tokens=50)
    h.run()
    assert h.tokens("a") == reference(prompt_of(1, 4), 8)
    assert h.last("a").finish_reason is FinishReason.LENGTH


# Rejection


def test_prompt_as_long_as_the_context_is_rejected_at_once() -> None:
    h = Harness(max_model_len=16)
    error = h.add("a", prompt_of(1, 16))
    assert error is not None and error.finish_reason is FinishReason.ERROR
    assert isinstance(error.stop_reason, str) and "context length is 16" in error.stop_reason
    assert not h.sched.has_unfinished_requests()
    assert h.add("b", prompt_of(1, 15), max_tokens=5) is None
    h.run()
    assert h.tokens("b") == reference(prompt_of(1, 15), 1)


def test_prompt_that_cannot_fit_the_whole_cache_is_rejected_at_once() -> None:
    h = Harness(num_blocks=2, block_size=4, max_model_len=100)
    error = h.add("a", prompt_of(1, 8))
    assert error is not None and error.finish_reason is FinishReason.ERROR
    assert "KV cache blocks" in str(error.stop_reason)
    assert not h.sched.has_unfinished_requests()
    assert h.add("b", prompt_of(1, 7), max_tokens=5) is None


def test_a_request_past_max_waiting_requests_is_refused_until_the_queue_drains() -> None:
    h = Harness(max_num_seqs=1, max_waiting_requests=2)
    for name in ("a", "b", "c"):  # a starts, b and c wait
        assert h.add(name, prompt_of(1, 4), max_tokens=3) is None
        if name == "a":
            h.step()
    refused = h.add("d", prompt_of(2, 4), max_tokens=3)
    assert refused is not None and refused.finish_reason is FinishReason.REFUSED
    assert "2 requests are waiting" in str(refused.stop_reason)
    assert "d" not in h.sched.requests
    h.run()
    assert h.add("d", prompt_of(2, 4), max_tokens=3) is None  # room again: taken
    h.run()
    assert h.tokens("d") == reference(prompt_of(2, 4), 3)
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks


def test_max_waiting_requests_0_is_no_bound() -> None:
    h = Harness(max_num_seqs=1, max_waiting_requests=0)
    assert all(h.add(f"r{i}", prompt_of(i, 4), max_tokens=1) is None for i in range(50))
    assert len(h.sched.waiting) == 50


def test_duplicate_live_request_id_is_rejected_but_reuse_after_finish_is_fine() -> None:
    h = Harness()
    assert h.add("a", prompt_of(1, 4), max_tokens=2) is None
    error = h.add("a", prompt_of(2, 4))
    assert error is not None and error.finish_reason is FinishReason.ERROR
    h.run()
    assert h.tokens("a") == reference(prompt_of(1, 4), 2)
    assert h.add("a", prompt_of(2, 4), max_tokens=1) is None


# Prefix caching


def test_shared_prefix_is_served_from_cache() -> None:
    h = Harness(block_size=4)
    shared = prompt_of(9, 8)
    h.add("a", [*shared, 1, 2, 3], max_tokens=5)
    h.step()
    h.add("b", [*shared, 4, 5], max_tokens=3)
    out = h.step()
    b = next(r for r in out.requests if r.request_id == "b")
    assert b.num_computed_tokens == 8 and b.token_ids == [4, 5]
    assert b.block_ids[:2] == h.sched.kv_cache.block_ids("a")[:2]
    h.run()
    assert h.last("b").num_cached_tokens == 8
    assert h.last("a").num_cached_tokens == 0
    assert h.tokens("b") == reference([*shared, 4, 5], 3)
    stats = h.sched.get_stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 11 + 10


def test_prefix_hit_leaves_the_last_prompt_token_to_recompute() -> None:
    h = Harness(block_size=4)
    prompt = prompt_of(3, 8)
    h.add("a", prompt, max_tokens=4)
    h.step()
    h.add("b", prompt, max_tokens=4)
    out = h.step()
    b = next(r for r in out.requests if r.request_id == "b")
    assert b.num_computed_tokens == 4 and b.token_ids == prompt[4:] and b.sample
    h.run()
    assert h.tokens("b") == h.tokens("a") == reference(prompt, 4)


def test_freed_cached_blocks_are_revived_by_a_later_hit() -> None:
    h = Harness(block_size=4)
    shared = prompt_of(5, 12)
    h.add("a", [*shared, 1], max_tokens=1)
    h.run()
    blocks_of_a = h.entries("a")[0][1].block_ids
    assert h.sched.kv_cache.usage == 0.0
    h.add("b", [*shared, 2], max_tokens=2)
    out = h.step()
    assert out.requests[0].block_ids[:3] == blocks_of_a[:3]
    assert out.requests[0].num_computed_tokens == 12
    h.run()
    assert h.tokens("b") == reference([*shared, 2], 2)


def test_only_requests_with_the_same_cache_salt_share_prefix_blocks() -> None:
    h = Harness(block_size=4)
    prompt = prompt_of(11, 9)
    h.add("a", prompt, max_tokens=2, cache_salt="tenant-a")
    h.run()
    for rid, salt in [("plain", None), ("b", "tenant-b"), ("a2", "tenant-a")]:
        h.add(rid, prompt, max_tokens=2, cache_salt=salt)
        h.run()
    assert [h.last(rid).num_cached_tokens for rid in ("a", "plain", "b", "a2")] == [0, 0, 0, 8]
    assert h.tokens("a2") == h.tokens("b") == reference(prompt, 2)


def test_without_prefix_caching_nothing_is_shared() -> None:
    h = Harness(block_size=4, enable_prefix_caching=False)
    shared = prompt_of(5, 12)
    h.add("a", [*shared, 1], max_tokens=2)
    h.step()
    h.add("b", [*shared, 2], max_tokens=2)
    h.run()
    b = h.entries("b")[0][1]
    assert b.num_computed_tokens == 0 and not set(b.block_ids) & set(h.entries("a")[0][1].block_ids)
    assert h.last("b").num_cached_tokens == 0
    assert h.sched.get_stats().prefix_cache_queries == 0


def test_reset_prefix_cache_forgets_blocks_in_use_and_their_later_blocks() -> None:
    """After new weights, no block computed before them may be hit: neither the cached ones a
    running request holds, nor the blocks it fills afterwards over its old content."""
    h = Harness(block_size=4)
    shared = prompt_of(5, 8)
    h.add("a", [*shared, 1], max_tokens=9)
    h.step()
    assert h.sched.reset_prefix_cache() == 2  # its two full prompt blocks
    h.run()  # "a" fills two more blocks, computed over the forgotten ones
    assert h.sched.kv_cache.pool.cached == {}
    h.add("b", [*shared, 1, *h.tokens("a")], max_tokens=1)
    out = h.step()
    assert out.requests[0].num_computed_tokens == 0  # nothing of "a" is reused
    h.run()
    h.add("c", [*shared, 1], max_tokens=1)
    out = h.step()
    assert out.requests[0].num_computed_tokens == 8  # "b", computed after the reset, is


def test_paused_with_wait_starts_nothing_new_but_finishes_what_started() -> None:
    h = Harness(block_size=4, num_blocks=8)
    h.add("a", prompt_of(1, 12), max_tokens=12)
    h.step()
    h.sched.admitting = False
    h.add("new", prompt_of(40, 4), max_tokens=2)
    h.add("b", prompt_of(60, 12), max_tokens=12)
    assert h.sched.started_requests() == 1
    while h.sched.started_requests():
        out = h.step()
        assert {r.request_id for r in out.requests} == {"a"}
    assert h.finished("a") and not h.outputs["new"] and not h.outputs["b"]
    h.sched.admitting = True
    h.run()
    assert h.finished("new") and h.finished("b")


def test_preempt_all_recomputes_every_running_request_the_same() -> None:
    h = Harness(block_size=4)
    h.add("a", prompt_of(1, 6), max_tokens=6)
    h.add("b", prompt_of(20, 9), max_tokens=6)
    h.step()
    h.step()
    assert h.sched.preempt_all() == 2
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks
    assert h.sched.started_requests() == 2
    h.run()
    assert h.tokens("a") == reference(prompt_of(1, 6), 6)
    assert h.tokens("b") == reference(prompt_of(20, 9), 6)


def test_abort_all_tells_each_client_and_frees_every_block() -> None:
    h = Harness(block_size=4)
    h.add("a", prompt_of(1, 6), max_tokens=6, client_index=0)
    h.add("b", prompt_of(20, 9), max_tokens=6, client_index=3)
    h.step()
    h.add("c", prompt_of(40, 5), max_tokens=6, client_index=3)
    told = h.sched.abort_all()
    assert sorted((client, o.request_id, str(o.finish_reason)) for client, o in told) == [
        (0, "a", "abort"), (3, "b", "abort"), (3, "c", "abort"),
    ]  # fmt: skip
    assert not h.sched.has_unfinished_requests()
    assert h.sched.kv_cache.num_free_blocks == h.config.num_blocks


def test_prompt_logprobs_skip_the_cache_and_cover_every_prompt_token() -> None:
    h = Harness(block_size=4, max_num_batched_tokens=5)
    prompt = prompt_of(5, 13)
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.add("b", prompt, max_tokens=2, prompt_logprobs=0)
    h.run()
    assert h.entries("b")[0][1].num_computed_tokens == 0
    rows = [o.new_prompt_logprobs for o in h.outputs["b"] if o.new_prompt_logprobs is not None]
    assert np.concatenate([r.token_ids[:, 0] for r in rows]).tolist() == prompt[1:]
    assert any(not o.new_token_ids for o in h.outputs["b"]), "chunk-only rows are forwarded"


def test_prompt_logprobs_are_not_sent_twice_after_preemption() -> None:
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=3, max_model_len=100)
    h.add("a", prompt_of(1, 2), max_tokens=13)
    prompt = prompt_of(2, 10)
    h.add("b", prompt, max_tokens=1, prompt_logprobs=1)
    h.run()
    assert h.sched.get_stats().num_preemptions >= 1
    rows = [o.new_prompt_logprobs for o in h.outputs["b"] if o.new_prompt_logprobs is not None]
    assert np.concatenate([r.token_ids[:, 0] for r in rows]).tolist() == prompt[1:]
    assert h.tokens("b") == reference(prompt, 1)


# Stop conditions


@pytest.mark.parametrize(
    ("script", "params", "tokens", "reason", "stop_reason"),
    [
        ([1, 2, 7, 3], {}, [1, 2, 7], FinishReason.STOP, None),
        (
            [1, 2, 7, 3],
            {"ignore_eos": True, "max_tokens": 4},
            [1, 2, 7, 3],
            FinishReason.LENGTH,
            None,
        ),
        ([1, 2, 3, 4], {"stop_token_ids": [3, 2]}, [1, 2], FinishReason.STOP, 2),
        ([1, 7, 7, 4], {"min_tokens": 3}, [1, 7, 7], FinishReason.STOP, None),
        (
            [1, 2, 3, 2],
            {"min_tokens": 3, "stop_token_ids": [2]},
            [1, 2, 3, 2],
            FinishReason.STOP,
            2,
        ),
        ([1, 2, 3, 4], {"max_tokens": 3}, [1, 2, 3], FinishReason.LENGTH, None),
        ([1, 2, 7, 4], {"max_tokens": 3}, [1, 2, 7], FinishReason.STOP, None),
    ],
    ids=[
        "eos",
        "ignore_eos",
        "stop_token_id",
        "min_tokens_eos",
        "min_tokens_stop_id",
        "max_tokens",
        "eos_before_length",
    ],
)
def test_stop_conditions(
    script: list[int],
    params: dict[str, Any],
    tokens: list[int],
    reason: FinishReason,
    stop_reason: int | None,
) -> None:
    h = Harness(script={"a": script})
    h.add("a", prompt_of(1, 5), eos_token_id=7, **({"max_tokens": 10} | params))
    h.run()
    assert h.tokens("a") == tokens
    assert h.last("a").finish_reason is reason
    assert h.last("a").stop_reason == stop_reason
    assert [o.finished for o in h.outputs["a"]] == [False] * (len(tokens) - 1) + [True]
    assert h.finished_requests[0] == ["a"]
    assert h.sched.kv_cache.usage == 0.0


def test_generation_stops_at_max_model_len() -> None:
    h = Harness(max_model_len=10)
    h.add("a", prompt_of(1, 8), max_tokens=None)
    h.run()
    assert h.tokens("a") == reference(prompt_of(1, 8), 2)
    assert h.last("a").finish_reason is FinishReason.LENGTH


def test_finished_request_is_forgotten_by_the_runner_next_step() -> None:
    h = Harness()
    h.add("a", prompt_of(1, 4), max_tokens=1)
    h.add("b", prompt_of(2, 4), max_tokens=3)
    h.step()
    assert h.step().finished_request_ids == ["a"]
    assert h.step().finished_request_ids == []


def test_finished_ids_wait_for_a_step_with_work() -> None:
    h = Harness()
    h.add("a", prompt_of(1, 4), max_tokens=1)
    h.step()
    assert not h.sched.has_unfinished_requests()
    empty = h.sched.schedule()  # an engine may not run the runner on this one
    assert not empty.requests and not empty.finished_request_ids
    h.add("b", prompt_of(2, 4), max_tokens=1)
    assert h.step().finished_request_ids == ["a"]


def test_outputs_are_grouped_by_client() -> None:
    h = Harness()
    h.add("a", prompt_of(1, 4), max_tokens=2, client_index=0)
    h.add("b", prompt_of(2, 4), max_tokens=2, client_index=3)
    out = h.schedule()
    per_client = h.sched.update_from_output(out, h.runner(out))
    assert {c: [o.request_id for o in outs.outputs] for c, outs in per_client.items()} == {
        0: ["a"],
        3: ["b"],
    }


# Aborts


def test_abort_mid_prefill_frees_every_block_at_once() -> None:
    h = Harness(block_size=4, max_num_batched_tokens=8, num_blocks=10)
    h.add("a", prompt_of(1, 30), max_tokens=3)
    h.step()
    assert h.sched.kv_cache.num_free_blocks == 8
    h.sched.abort_requests(["a", "a", "unknown"])
    h.sched.abort_requests(["a"])
    assert h.sched.kv_cache.num_free_blocks == 10 and h.sched.kv_cache.usage == 0.0
    assert not h.sched.has_unfinished_requests()
    h.add("b", prompt_of(2, 4), max_tokens=1)
    out = h.step()
    assert out.finished_request_ids == ["a"]
    assert h.finished_requests[0] == ["a", "b"]
    assert "a" not in h.runner.known


def test_abort_after_preemption_removes_the_waiting_request() -> None:
    h = Harness(num_blocks=6, enable_prefix_caching=False)
    for i, name in enumerate("abc"):
        h.add(name, prompt_of(i, 4), max_tokens=10)
    while not h.sched.get_stats().num_preemptions:
        h.step()
    h.sched.abort_requests(["c", "b"])
    assert not h.sched.waiting and [r.request_id for r in h.sched.running] == ["a"]
    assert h.sched.kv_cache.num_free_blocks == 6 - len(h.sched.kv_cache.block_ids("a"))
    out = h.step()
    assert sorted(out.finished_request_ids) == ["b", "c"]
    h.run()
    assert h.sched.kv_cache.num_free_blocks == 6
    assert "c" not in h.runner.known and h.tokens("a") == reference(prompt_of(0, 4), 10)


def test_results_of_requests_aborted_during_the_step_are_dropped() -> None:
    h = Harness()
    h.add("a", prompt_of(1, 4), max_tokens=5)
    h.add("b", prompt_of(2, 4), max_tokens=5)
    out = h.schedule()
    h.sched.abort_requests(["a"])
    assert h.add("a", prompt_of(3, 4), max_tokens=1) is None  # the id is free again
    h.finish_step(out)
    assert "a" not in h.outputs and len(h.outputs["b"]) == 1
    assert h.finished_requests[0] == ["a"]
    out = h.step()
    assert out.finished_request_ids == ["a"]
    assert next(r for r in out.requests if r.request_id == "a").new is not None
    h.run()
    assert h.tokens("a") == reference(prompt_of(3, 4), 1)


def test_stats_report_queues_and_cache() -> None:
    h = Harness(num_blocks=10, max_num_seqs=1)
    h.add("a", prompt_of(1, 8), max_tokens=3)
    h.add("b", prompt_of(2, 8), max_tokens=3)
    h.step()
    stats = h.sched.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    # 8 prompt tokens computed in 2 blocks; the sampled 9th gets its block when scheduled
    assert (stats.num_free_blocks, stats.num_total_blocks) == (8, 10)
    assert stats.kv_cache_usage == pytest.approx(0.2)


def _finish(h: Harness, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
    for outputs in h.sched.update_from_output(out, result).values():
        for output in outputs.outputs:
            h.outputs[output.request_id].append(output)


def test_steps_in_flight_split_the_requests_and_give_the_reference_tokens() -> None:
    """The pipeline-parallel batch queue: two steps in flight at once, the runner computing
    them in order and its results arriving a step late."""
    h = Harness(max_num_batched_tokens=16)  # long prompts take several chunks
    for i in range(5):
        h.add(f"r{i}", prompt_of(i, 6 + 7 * i), max_tokens=10, ignore_eos=True)
    pending: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    sizes = []
    while h.sched.has_unfinished_requests():
        while len(pending) < 2:
            share = -(-len(h.sched.requests) // 2)
            out = h.sched.schedule(max_requests=share, preempt=not pending)
            if not out.requests:
                break
            assert len(out.requests) <= share
            for earlier, _ in pending:
                for r in earlier.requests:
                    # only a prompt chunk that does not sample lets its request go on
                    if r.request_id in {x.request_id for x in out.requests}:
                        assert not r.sample
            sizes.append(len(out.requests))
            pending.append((out, h.runner(out)))
        assert pending, "nothing in flight and nothing to schedule"
        _finish(h, *pending.popleft())
    for i in range(5):
        assert h.tokens(f"r{i}") == reference(h.prompts[f"r{i}"], 10)
    assert max(sizes) == 3  # micro-batches of at most half the requests, rounded up
    assert h.sched.kv_cache.pool.num_free == h.config.num_blocks


def test_a_step_scheduled_beside_one_in_flight_never_preempts() -> None:
    # 6 blocks of 4 tokens, all taken by two prompts of 10 and 11 tokens
    h = Harness(num_blocks=6, max_model_len=24)
    h.add("a", prompt_of(1, 10), max_tokens=8, ignore_eos=True)
    h.add("b", prompt_of(2, 11), max_tokens=8, ignore_eos=True)
    h.step()
    h.step()  # a holds 12 tokens (its blocks have room for one more), b 13 (b's are full)
    assert h.sched.kv_cache.pool.num_free == 0
    first = h.sched.schedule(max_requests=1)
    assert [r.request_id for r in first.requests] == ["a"]
    in_flight = (first, h.runner(first))
    # b needs a block; the only way to one is preempting a, whose step is in flight
    second = h.sched.schedule(preempt=False)
    assert second.requests == []
    assert h.sched.num_preemptions == 0
    _finish(h, *in_flight)
    h.run()  # nothing in flight: now preemption may free blocks
    assert h.sched.num_preemptions > 0
    assert h.tokens("a") == reference(h.prompts["a"], 8)
    assert h.tokens("b") == reference(h.prompts["b"], 8)
