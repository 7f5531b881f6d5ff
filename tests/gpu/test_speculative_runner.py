"""The model runner verifying proposals (speculative decoding) on tiny random models: greedy
output with proposals is greedy output without them, token for token and logprob for logprob,
whether the proposals are right, wrong or half right, in a batch beside plain decodes and a
prompt chunk, with penalties that count the proposals before each row."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from runner_driver import GREEDY, Driver, Seq

from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import SamplingParams, ScheduledRequest, SchedulerOutput


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def _runner(model_dir: Path, **kwargs: object) -> ModelRunner:
    options: dict = {
        "dtype": "float32",
        "kv_cache_memory": 1 << 21,
        "max_model_len": 512,
        "num_threads": 1,
    }
    return ModelRunner(model_dir, **(options | kwargs))


def _prompt(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 250), k=n)


def _plain(runner: ModelRunner, prompts: dict[str, list[int]], n: int, params) -> dict[str, Seq]:
    d = Driver(runner)
    for rid, prompt in prompts.items():
        d.add(rid, prompt, params)
    d.run(n)
    return d.seqs


def _speculating(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    truth: dict[str, list[int]],
    n: int,
    params: SamplingParams,
    spoil: dict[str, str],
    k: int = 4,
) -> Driver:
    """Decode with proposals from `truth` (each request's true output), spoiled per request:
    "none" (all right), "all" (all wrong), "second" (the second of each wrong), "plain" (no
    proposals); a request named "chunked" gets its prompt in chunks of 5 meanwhile."""
    d = Driver(runner)
    for rid, prompt in prompts.items():
        d.add(rid, prompt, params)
    while any(len(s.output) < n for s in d.seqs.values()):
        drafts = {}
        for rid, seq in d.seqs.items():
            done = len(seq.output)
            right = truth[rid][done : done + k]
            if spoil[rid] == "plain" or not right:
                continue
            wrong = [(t + 7) % 250 + 3 for t in right]
            pick = {"none": right, "all": wrong, "second": right[:1] + wrong[1:2] + right[2:]}
            drafts[rid] = pick[spoil[rid]]
        d.step({"chunked": 5}, drafts)
    return d


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(
            temperature=0.0,
            max_tokens=None,
            logprobs=2,
            repetition_penalty=1.4,
            frequency_penalty=0.6,
            presence_penalty=0.3,
        ),
    ],
    ids=["greedy", "greedy-with-penalties"],
)
def test_greedy_with_proposals_is_greedy_without(tiny: Path, params: SamplingParams) -> None:
    prompts = {rid: _prompt(7 + 5 * i, i) for i, rid in enumerate(["a", "b", "c", "d", "chunked"])}
    spoil = {"a": "none", "b": "all", "c": "second", "d": "plain", "chunked": "none"}
    reference = _plain(_runner(tiny), prompts, 20, params)
    truth = {rid: seq.output for rid, seq in reference.items()}
    d = _speculating(_runner(tiny), prompts, truth, 20, params, spoil)
    for rid, seq in d.seqs.items():
        assert seq.output[:20] == truth[rid][:20], rid
        ours = np.concatenate([lp.logprobs for lp in seq.logprobs[:20]])
        theirs = np.concatenate([lp.logprobs for lp in reference[rid].logprobs[:20]])
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
        ids = [lp.token_ids[0, 0] for lp in seq.logprobs[:20]]
        assert ids == seq.output[:20]  # a logprob row per emitted token, in order
    assert d.accepted >= 15  # "a" and "chunked" have every proposal accepted


def test_penalties_see_the_proposals_before_each_row(tiny: Path) -> None:
    """With a repetition penalty strong enough to forbid repeats, proposals that repeat a
    token already proposed earlier in the same step must be judged as repeats."""
    params = SamplingParams(temperature=0.0, max_tokens=None, repetition_penalty=50.0)
    prompt = _prompt(6, 11)
    reference = _plain(_runner(tiny), {"r": prompt}, 16, params)["r"].output
    assert len(set(reference)) == len(reference)  # the penalty forbids every repeat
    runner = _runner(tiny)
    d = Driver(runner)
    d.add("r", prompt, params)
    d.step()  # the prompt, and the first token
    # the true next token twice: the second is a repeat of the first, so it must be refused
    seq = d.seqs["r"]
    d.step(drafts={"r": [reference[1], reference[1], reference[2]]})
    assert seq.output[:2] == reference[:2]
    assert seq.output[2] != reference[1]
    assert seq.output[:3] == reference[:3]


def test_seeded_sampling_with_proposals_reproduces(tiny: Path) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=None)
    prompt = _prompt(9, 5)
    truth = _plain(_runner(tiny), {"r": prompt}, 24, params)["r"].output
    outputs = []
    for _ in range(2):
        d = _speculating(_runner(tiny), {"r": prompt}, {"r": truth}, 24, params, {"r": "none"})
        outputs.append(d.seqs["r"].output[:24])
    assert outputs[0] == outputs[1]


def test_verify_rows_of_a_windowed_model_see_only_their_window(tmp_path: Path) -> None:
    model = build_tiny_model(
        tmp_path / "windowed",
        architecture="gemma3",
        num_layers=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    prompts = {"w": _prompt(20, 3)}
    reference = _plain(_runner(model), prompts, 12, GREEDY)
    truth = {"w": reference["w"].output}
    d = _speculating(_runner(model), prompts, truth, 12, GREEDY, {"w": "second"})
    assert d.seqs["w"].output[:12] == truth["w"][:12]


@pytest.mark.parametrize(
    ("token_ids", "num_draft_tokens", "sample"),
    [([5, 6, 7], 3, True), ([5, 6, 7], -1, True), ([5, 6, 7], 2, False)],
    ids=["all-proposals", "negative", "not-sampling"],
)
def test_a_step_with_impossible_proposals_is_refused(
    tiny: Path, token_ids: list[int], num_draft_tokens: int, sample: bool
) -> None:
    runner = _runner(tiny)
    d = Driver(runner)
    d.add("r", _prompt(6, 1))
    d.step()
    seq = d.seqs["r"]
    bad = ScheduledRequest(
        "r", token_ids, seq.computed, [*seq.blocks, d.free.pop(0)], sample=sample,
        num_draft_tokens=num_draft_tokens,
    )  # fmt: skip
    with pytest.raises(ValueError, match="proposals"):
        runner.execute(SchedulerOutput(99, [bad]))
