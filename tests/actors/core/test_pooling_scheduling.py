"""Pooling requests in the scheduler: prefill-only, finished by the step that ends their prompt
with its pooled output, their blocks freed; an encoder's prompts never split; what a model does
not serve refused at once."""

from __future__ import annotations

from typing import Any

import numpy as np

from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.wire import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    PoolingParams,
    RequestStepResult,
    SamplingParams,
    SchedulerOutput,
)


def _scheduler(**config: Any) -> Scheduler:
    defaults: dict[str, Any] = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=32,
        pooling_tasks=frozenset({"embed"}),
        generates=False,
    )
    return Scheduler(SchedulerConfig(**(defaults | config)))


def _add(sched: Scheduler, request_id: str, prompt: list[int], task: str | None = "embed"):
    pooling = None if task is None else PoolingParams(task)
    request = EngineCoreRequest(
        request_id, prompt, SamplingParams(max_tokens=1), pooling_params=pooling
    )
    return sched.add_request(request)


class PoolingRunner:
    """Pools each prompt as the sum of its tokens, from every chunk a step computes, and
    returns it from the step that ends the prompt, as a runner does."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.chunks: dict[str, list[int]] = {}

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        results = []
        for r in out.requests:
            self.sums[r.request_id] = self.sums.get(r.request_id, 0.0) + sum(r.token_ids)
            self.chunks.setdefault(r.request_id, []).append(len(r.token_ids))
            if r.sample:
                pooled = np.array([self.sums[r.request_id]], np.float32)
                results.append(RequestStepResult(r.request_id, pooled=pooled))
        return ModelRunnerOutput(out.step, results)


def _run(sched: Scheduler, runner: PoolingRunner) -> dict[str, EngineCoreOutput]:
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            return finished
        out = sched.schedule()
        for outputs in sched.update_from_output(out, runner(out)).values():
            for output in outputs.outputs:
                assert output.request_id not in finished, "an output after the finish"
                finished[output.request_id] = output
    raise AssertionError("requests did not finish")


def test_a_pooling_request_ends_with_its_prompt_and_frees_its_blocks() -> None:
    sched, runner = _scheduler(), PoolingRunner()
    prompts = {"a": list(range(1, 31)), "b": [5, 6, 7]}  # a: chunked over two steps
    for rid, prompt in prompts.items():
        assert _add(sched, rid, prompt) is None
    finished = _run(sched, runner)
    for rid, prompt in prompts.items():
        out = finished[rid]
        assert out.finish_reason is FinishReason.STOP and out.new_token_ids == []
        assert out.pooled is not None and out.pooled.tolist() == [float(sum(prompt))]
    assert runner.chunks["a"] == [16, 14]
    stats = sched.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0


def test_an_encoder_computes_each_prompt_whole_in_one_step() -> None:
    sched, runner = _scheduler(whole_prompts=True, enable_prefix_caching=False), PoolingRunner()
    for rid in "abc":
        assert _add(sched, rid, list(range(1, 11))) is None  # the same prompt, nothing shared
    _run(sched, runner)
    assert all(chunks == [10] for chunks in runner.chunks.values())  # none split, one a step


def test_an_encoder_refuses_a_prompt_longer_than_a_step_at_once() -> None:
    sched = _scheduler(whole_prompts=True, enable_prefix_caching=False)
    refused = _add(sched, "long", list(range(1, 18)))
    assert refused is not None and refused.finish_reason is FinishReason.ERROR
    assert "max_num_batched_tokens" in str(refused.stop_reason)


def test_a_pooling_prompt_may_fill_the_whole_context() -> None:
    sched = _scheduler(max_num_batched_tokens=32)
    assert _add(sched, "full", list(range(1, 33))) is None
    too_long = _add(sched, "over", list(range(1, 34)))
    assert too_long is not None and too_long.finish_reason is FinishReason.ERROR


def test_a_model_refuses_what_it_does_not_serve() -> None:
    pooling_only = _scheduler()
    generate = _add(pooling_only, "gen", [1, 2, 3], task=None)
    assert generate is not None and "pooling requests only" in str(generate.stop_reason)
    classify = _add(pooling_only, "cls", [1, 2, 3], task="classify")
    assert classify is not None and "'classify'" in str(classify.stop_reason)
    generating = _scheduler(pooling_tasks=frozenset(), generates=True)
    embed = _add(generating, "emb", [1, 2, 3])
    assert embed is not None and "generates text" in str(embed.stop_reason)
