"""The scheduler and its KV block manager, driven by operations decoded from the bytes.

Operations: add a request (random length, shared prefixes, stop rules, priorities, prompt
logprobs), abort (known and unknown ids), a step (schedule, then a fake runner's tokens, plus
junk results the scheduler must ignore), an abort while a step runs (with the id reused at once),
and a prefix-cache reset. After every operation the block accounting balances exactly (reference
counts equal the block tables' references and are never negative, the free queue holds exactly
the unreferenced blocks, the hash index matches the hashed blocks), the queues hold exactly the
live requests, and each step respects its budgets and never stalls. Every request finishes
exactly once; at the end, aborting everything (or running it to completion) frees every block.

Input layout: six configuration bytes (see `trace_input`), then one operation per byte group.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    RequestStepResult,
    SamplingParams,
    SchedulerOutput,
)

from .source import ByteSource

IDS = [f"r{i}" for i in range(8)]  # few ids, so that they are reused after finishing
VOCAB = 24  # small, so that EOS and stop tokens come up
BASES = [[(seed * 7 + i * 5) % VOCAB for i in range(64)] for seed in range(3)]  # shared prefixes
MAX_OPS = 200
DRAIN_STEPS = 3000

ADD, ABORT, STEP, ABORT_DURING_STEP, RESET, STEPS = range(6)


def trace_input(config: bytes, ops: list[bytes]) -> bytes:
    """A trace with six configuration bytes and operations already laid out (seed corpora)."""
    return config.ljust(6, b"\0")[:6] + b"".join(ops)


@dataclasses.dataclass(eq=False)
class Track:
    """What the harness knows about one submitted request."""

    request_id: str
    prompt_len: int
    finishes: int = 0


class Trace:
    def __init__(self, src: ByteSource) -> None:
        self.src = src
        self.config = SchedulerConfig(
            num_blocks=src.int(1, 24),
            block_size=src.choice([1, 2, 4, 16]),
            max_num_seqs=src.int(1, 6),
            max_num_batched_tokens=src.int(1, 48),
            max_model_len=src.int(2, 96),
            enable_prefix_caching=src.bool(),
        )
        self.sched = Scheduler(self.config)
        self.live: dict[str, Track] = {}
        self.tracks: list[Track] = []
        # What the fake runner holds state for: id -> (prompt length, wants prompt logprobs).
        self.known: dict[str, tuple[int, bool]] = {}
        self.aborted_since_update: list[str] = []

    def run(self) -> None:
        drain = self.src.bool()
        for _ in range(MAX_OPS):
            if not self.src.remaining:
                break
            self.op(self.src.byte() % 6)
            self.check_blocks()
            self.check_queues()
        if drain:
            for _ in range(DRAIN_STEPS):
                if not self.sched.has_unfinished_requests():
                    break
                self.step()
            assert not self.sched.has_unfinished_requests(), "requests never finished"
        else:
            ids = list(self.live)
            self.sched.abort_requests(ids)
            self.aborted(ids)
        self.check_blocks()
        kv = self.sched.kv_cache
        assert kv.num_free_blocks == self.config.num_blocks, "blocks leaked"
        assert not kv.req_blocks and not self.sched.requests
        assert not self.sched.running and not self.sched.waiting
        assert all(track.finishes == 1 for track in self.tracks), "a request never finished"
        self.sched.reset_prefix_cache()
        assert not kv.pool.cached, "a prefix survived the reset"

    def op(self, op: int) -> None:
        if op == ADD:
            self.add(self.src.choice(IDS))
        elif op == ABORT:
            ids = [self.src.choice([*IDS, "unknown"]) for _ in range(self.src.int(0, 3))]
            self.sched.abort_requests(ids)
            self.aborted(ids)
        elif op == STEP:
            self.step()
        elif op == ABORT_DURING_STEP:
            out = self.schedule()
            request_id = self.src.choice(IDS)
            self.sched.abort_requests([request_id])
            self.aborted([request_id])
            if self.src.bool():
                self.add(request_id)
            self.update(out)
        elif op == RESET:
            free = self.sched.kv_cache.num_free_blocks
            self.sched.reset_prefix_cache()  # blocks in use too: none keeps a hash
            assert not self.sched.kv_cache.pool.cached, "a prefix survived the reset"
            assert self.sched.kv_cache.num_free_blocks == free, "the reset freed or took blocks"
        else:
            for _ in range(self.src.int(1, 8)):
                self.step()

    def add(self, request_id: str) -> None:
        src = self.src
        length = src.int(1, 100)
        shared = src.int(0, length)
        prompt = BASES[src.int(0, 2)][:shared] + [
            src.int(0, VOCAB - 1) for _ in range(length - shared)
        ]
        max_tokens = None if src.chance(4) else src.int(1, 24)
        min_tokens = src.int(0, 3)
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=[src.int(0, VOCAB - 1) for _ in range(src.int(0, 2))],
            ignore_eos=src.bool(),
            prompt_logprobs=0 if src.chance(4) else None,
        )
        eos = None if src.chance(3) else src.int(0, VOCAB - 1)
        request = EngineCoreRequest(request_id, prompt, params, eos, priority=src.int(-1, 1))
        error = self.sched.add_request(request)
        fits = len(prompt) < min(self.config.max_model_len, self.sched.max_len)
        if request_id in self.live or not fits:
            assert error is not None and error.finish_reason is FinishReason.ERROR
            return
        assert error is None, f"refused a request that fits: {error.stop_reason}"
        self.live[request_id] = track = Track(request_id, len(prompt))
        self.tracks.append(track)

    def aborted(self, ids: list[str]) -> None:
        for request_id in ids:
            track = self.live.pop(request_id, None)
            if track is not None:
                track.finishes += 1
                self.aborted_since_update.append(request_id)

    def step(self) -> None:
        self.update(self.schedule())

    def schedule(self) -> SchedulerOutput:
        busy = self.sched.has_unfinished_requests()
        out = self.sched.schedule()
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(out.requests) <= self.config.max_num_seqs
        assert not busy or out.requests, "live requests but nothing scheduled: a stall"
        assert len({r.request_id for r in out.requests}) == len(out.requests)
        for request_id in out.finished_request_ids:
            assert request_id in self.known, "the runner is told to forget an unknown request"
            del self.known[request_id]
        for entry in out.requests:
            assert entry.token_ids, "a request scheduled with no tokens"
            assert (entry.new is not None) is (entry.request_id not in self.known)
            if entry.new is not None:
                wants = entry.new.sampling_params.prompt_logprobs is not None
                self.known[entry.request_id] = (len(entry.new.prompt_token_ids), wants)
            end = entry.num_computed_tokens + len(entry.token_ids)
            assert end <= self.sched.max_len
            blocks = -(-end // self.config.block_size)
            assert len(entry.block_ids) >= blocks, "too few blocks for the scheduled tokens"
        return out

    def update(self, out: SchedulerOutput) -> None:
        results = []
        for entry in out.requests:
            prompt_len, wants = self.known[entry.request_id]
            # A chunk from position c has logprobs for prompt tokens c+1, ..., up to the last.
            start = entry.num_computed_tokens
            rows = min(start + len(entry.token_ids), prompt_len - 1) - start
            prompt_logprobs = _logprobs(rows) if wants and rows > 0 else None
            if entry.sample or prompt_logprobs is not None:
                token = self.src.int(0, VOCAB - 1) if entry.sample else None
                results.append(RequestStepResult(entry.request_id, token, None, prompt_logprobs))
        if self.src.chance(8):  # results the scheduler must ignore
            results.append(RequestStepResult(self.src.choice([*IDS, "x"]), 1))
        per_client = self.sched.update_from_output(out, ModelRunnerOutput(out.step, results))
        reported: Counter[str] = Counter()
        finished = Counter(self.aborted_since_update)
        self.aborted_since_update = []
        for outputs in per_client.values():
            reported.update(outputs.finished_requests or ())
            finished.update(self.outputs(outputs, {r.request_id for r in out.requests}))
        assert reported == finished, "finished_requests does not name what finished"

    def outputs(self, outputs: EngineCoreOutputs, scheduled: set[str]) -> list[str]:
        """The ids that `outputs` finish."""
        finished = []
        for output in outputs.outputs:
            assert output.request_id in scheduled, "output for a request that was not scheduled"
            track = self.live.get(output.request_id)
            assert track is not None, "output for a finished request"
            assert len(output.new_token_ids) <= 1
            if output.finish_reason is not None:
                assert output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                finished.append(output.request_id)
                track.finishes += 1
                del self.live[output.request_id]
        return finished

    def check_blocks(self) -> None:
        kv = self.sched.kv_cache
        refs = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
        for block in kv.pool.blocks:
            assert block.ref_cnt >= 0, f"negative reference count: {block}"
            assert block.ref_cnt == refs[block.block_id], f"reference count off: {block}"
            assert (block.ref_cnt == 0) == (block.block_id in kv.pool.free_queue)
        assert len(kv.pool.free_queue) == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
        hashed = [b for b in kv.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(kv.pool.cached)
        assert all(kv.pool.cached[b.block_hash] is b for b in hashed if b.block_hash)
        for request_id, blocks in kv.req_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in a table"
            assert request_id in self.sched.requests

    def check_queues(self) -> None:
        running, waiting = self.sched.running, self.sched.waiting
        assert len(running) <= self.config.max_num_seqs
        assert sorted(r.request_id for r in running + waiting) == sorted(self.live)
        assert set(self.sched.requests) == set(self.live)
        assert running == sorted(running, key=lambda r: r.sort_key)
        assert waiting == sorted(waiting, key=lambda r: r.sort_key)
        assert all(r.num_computed_tokens == 0 for r in waiting)
        assert set(self.sched.kv_cache.req_blocks) <= {r.request_id for r in running}


def _logprobs(rows: int) -> Logprobs:
    return Logprobs(
        np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.float32), np.ones(rows, np.int32)
    )


def test_one_input(data: bytes) -> None:
    Trace(ByteSource(data)).run()
