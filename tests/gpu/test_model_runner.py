"""ModelRunner against Hugging Face transformers, and against itself under paging, chunking,
batching and preemption."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from runner_driver import Driver, Seq

from triode.gpu import model_runner
from triode.gpu.attention import AttentionMetadata, PrefillChunk
from triode.gpu.loader import transformers_directory
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, logprobs=3)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama": {},
    "qwen2-qkv-bias": {"architecture": "qwen2"},
    "llama3-rope": {"rope_scaling": LLAMA3_ROPE},
    "untied": {"tie_word_embeddings": False, "num_kv_heads": 4},
}


@functools.cache
def _tiny(tmp_root: Path, variant: str) -> Path:
    return build_tiny_model(tmp_root / variant, **VARIANTS[variant])


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny(tmp_root: Path) -> Path:
    return _tiny(tmp_root, "llama")


def _runner(model_dir: Path, **kwargs: object) -> ModelRunner:
    # one thread: tiny matmuls gain nothing from two, and a second OpenMP thread stalls every
    # op for a scheduler tick whenever the machine is oversubscribed (parallel test runs)
    options: dict = {
        "dtype": "float32",
        "kv_cache_memory": 1 << 21,
        "max_model_len": 512,
        "num_threads": 1,
    }
    return ModelRunner(model_dir, **(options | kwargs))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).choices(range(3, 250), k=n)


def _generate(runner: ModelRunner, prompt: list[int], n: int, **driver: object) -> Seq:
    d = Driver(runner, **driver)  # type: ignore[arg-type]
    d.add("r", prompt)
    d.run(n)
    return d.seqs["r"]


def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()


def _logprob_rows(seq: Seq) -> np.ndarray:
    return np.concatenate([lp.logprobs for lp in seq.logprobs])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_root: Path, variant: str) -> None:
    model_dir = _tiny(tmp_root, variant)
    runner = _runner(model_dir)
    prompt = _prompt(100)  # past llama3's original 64 positions, into the rescaled band
    n = len(prompt)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decodes=0,
        decodes=(),
        prefills=(PrefillChunk.build(0, n, 0, torch.arange(-(-n // runner.block_size))),),
    )
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(torch.tensor(prompt), torch.arange(n), meta)
        )
        theirs = _hf(model_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen2-qkv-bias"])
def test_greedy_decoding_matches_transformers_generate(tmp_root: Path, variant: str) -> None:
    model_dir = _tiny(tmp_root, variant)
    prompt = _prompt(37, seed=variant == "llama")
    with torch.inference_mode():
        hf = _hf(model_dir).generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )
    assert _generate(_runner(model_dir), prompt, 20).output == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("rows_at_once", [256, 7])
def test_prompt_logprobs_match_transformers(
    tiny: Path, rows_at_once: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 7: the 29 positions' logits are computed 7 rows at a time and joined
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", rows_at_once)
    prompt = _prompt(30)
    d = Driver(_runner(tiny))
    d.add("r", prompt, SamplingParams(temperature=0.0, prompt_logprobs=4))
    d.step()
    [lp] = d.seqs["r"].prompt_logprobs
    with torch.inference_mode():
        expected = torch.log_softmax(_hf(tiny)(torch.tensor([prompt])).logits[0, :-1], -1)
    assert lp.token_ids.shape == (29, 5)
    assert lp.token_ids[:, 0].tolist() == prompt[1:]
    np.testing.assert_allclose(lp.logprobs[:, 0], expected[range(29), prompt[1:]], atol=1e-4)
    np.testing.assert_allclose(lp.logprobs[:, 1:], expected.topk(4).values, atol=1e-4)


def test_shuffled_non_contiguous_blocks_give_the_same_tokens(tiny: Path) -> None:
    prompt = _prompt(45)
    contiguous = _generate(_runner(tiny), prompt, 12)
    shuffled = _generate(_runner(tiny), prompt, 12, shuffle_blocks=True)
    assert shuffled.output == contiguous.output
    np.testing.assert_allclose(_logprob_rows(shuffled), _logprob_rows(contiguous), atol=1e-5)


def test_chunked_prefill_matches_one_shot(tiny: Path) -> None:
    prompt = _prompt(40, seed=3)
    params = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2)
    one_shot, chunked = Driver(_runner(tiny)), Driver(_runner(tiny))
    one_shot.add("r", prompt, params)
    chunked.add("r", prompt, params)
    for _ in range(3):  # 14 + 14 + 12 tokens over three calls; only the last one samples
        chunked.step({"r": 14})
    assert len(chunked.seqs["r"].output) == 1
    one_shot.run(8)
    chunked.run(8)
    a, b = one_shot.seqs["r"], chunked.seqs["r"]
    assert b.output == a.output
    np.testing.assert_allclose(_logprob_rows(b), _logprob_rows(a), atol=1e-5)
    assert [len(lp.ranks) for lp in b.prompt_logprobs] == [14, 14, 11]
    chunked_rows = np.concatenate([lp.logprobs for lp in b.prompt_logprobs])
    np.testing.assert_allclose(chunked_rows, a.prompt_logprobs[0].logprobs, atol=1e-5)


def test_mixed_batch_of_prefill_and_decodes_matches_each_alone(tiny: Path) -> None:
    prompts = {"a": _prompt(20, 1), "b": _prompt(33, 2), "c": _prompt(7, 3), "d": _prompt(50, 4)}
    alone = {rid: _generate(_runner(tiny), p, 10) for rid, p in prompts.items()}
    d = Driver(_runner(tiny), shuffle_blocks=True)
    for rid in "abc":
        d.add(rid, prompts[rid])
    d.step()
    d.step()
    d.add("d", prompts["d"])  # its prefill chunks share steps with the others' decodes
    d.step({"d": 24})
    d.step({"d": 24})
    d.run(10)
    for rid, seq in d.seqs.items():
        assert seq.output[:10] == alone[rid].output[:10], rid
        np.testing.assert_allclose(
            _logprob_rows(seq)[:10], _logprob_rows(alone[rid])[:10], atol=1e-5
        )


def test_preempted_request_recomputes_without_repeating_prompt_logprobs(tiny: Path) -> None:
    prompt = _prompt(25, seed=5)
    params = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)
    reference = Driver(_runner(tiny))
    reference.add("r", prompt, params)
    reference.run(10)
    d = Driver(_runner(tiny))
    d.add("r", prompt, params)
    d.run(4)
    d.preempt("r")
    d.step({"r": 10})  # recompute prompt + outputs in two chunks
    d.run(10)
    assert d.seqs["r"].output == reference.seqs["r"].output
    assert sum(len(lp.ranks) for lp in d.seqs["r"].prompt_logprobs) == len(prompt) - 1


def test_results_only_for_requests_that_sampled_and_in_schedule_order(tiny: Path) -> None:
    runner = _runner(tiny)
    new = NewRequestData(_prompt(20), GREEDY)
    out = runner.execute(
        SchedulerOutput(
            0,
            [
                ScheduledRequest("x", _prompt(20)[:10], 0, [0], sample=False, new=new),
                ScheduledRequest("y", _prompt(5), 0, [1], new=NewRequestData(_prompt(5), GREEDY)),
                ScheduledRequest("z", _prompt(3), 0, [2], new=NewRequestData(_prompt(3), GREEDY)),
            ],
        )
    )
    assert [r.request_id for r in out.results] == ["y", "z"]
    assert all(r.token_id is not None and r.logprobs is not None for r in out.results)


def test_finished_requests_are_forgotten(tiny: Path) -> None:
    d = Driver(_runner(tiny))
    d.add("r", _prompt(5))
    d.run(2)
    d.finish("r")
    d.step()  # carries the finished id
    with pytest.raises(KeyError, match="NewRequestData"):
        d.runner.execute(SchedulerOutput(9, [ScheduledRequest("r", [5], 7, [0])]))


def test_kv_cache_too_small_for_max_model_len_is_refused(tiny: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        _runner(tiny, kv_cache_memory=4096, max_model_len=512)


# --- the real default model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_prompts(smollm2: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    return {
        "story": tok("Once upon a time, in a small village,")["input_ids"],
        "chat": tok(
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"],
        "code": tok("def fibonacci(n):\n    ")["input_ids"],
    }


@pytest.fixture(scope="module")
def real_reference(smollm2: Path, real_prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    model = _hf(smollm2)
    out = {}
    with torch.inference_mode():
        for rid, prompt in real_prompts.items():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
            out[rid] = ids[0, len(prompt) :].tolist()
    return out


def _assert_same_greedy(ours: list[int], reference: list[int], eos: int | None) -> None:
    """Equal token for token; `generate` stops at EOS where our driver goes on."""
    assert ours[: len(reference)] == reference
    assert len(reference) == 24 or reference[-1] == eos


@pytest.mark.slow
def test_real_model_greedy_matches_transformers_alone_and_batched(
    smollm2: Path, real_prompts: dict[str, list[int]], real_reference: dict[str, list[int]]
) -> None:
    runner = ModelRunner(
        smollm2,
        dtype="float32",
        kv_cache_memory=64 << 20,
        max_model_len=1024,
        num_threads=1,  # see _runner: robust when other test processes share the cores
    )
    for rid, prompt in real_prompts.items():
        seq = _generate(runner, prompt, 24)
        _assert_same_greedy(seq.output, real_reference[rid], runner.eos_token_id)
    d = Driver(runner, shuffle_blocks=True)
    for rid, prompt in real_prompts.items():
        d.add(rid, prompt)
    d.run(24)
    for rid, seq in d.seqs.items():
        _assert_same_greedy(seq.output, real_reference[rid], runner.eos_token_id)


@pytest.mark.parametrize(
    ("generation_config", "config_eos", "expected"),
    [
        ({"eos_token_id": [128001, 128009]}, 128001, [128001, 128009]),
        ({"eos_token_id": 2}, [2, 7], [2, 7]),
        (None, 5, [5]),
        ({}, None, []),
    ],
)
def test_eos_token_ids_list_the_main_one_first_without_repeats(
    tmp_path: Path, generation_config: dict | None, config_eos: object, expected: list[int]
) -> None:
    import json
    from types import SimpleNamespace

    from triode.gpu.model_files import eos_token_ids

    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=config_eos)) == expected


def test_decodes_group_by_power_of_two_block_counts() -> None:
    from triode.gpu.batch import decode_groups

    assert decode_groups([]) == []
    assert decode_groups([1, 1, 2, 3, 4, 5, 8, 9, 120]) == [
        (0, 2),
        (2, 3),
        (3, 5),
        (5, 7),
        (7, 8),
        (8, 9),
    ]
    assert decode_groups([7, 7, 8]) == [(0, 3)]


def test_a_long_context_decode_among_short_ones_gives_each_the_same_tokens(tiny: Path) -> None:
    # one 90-token context beside two 5-token ones: three groups of their own, not one padded
    # to 90; the tokens are those each request generates alone
    prompts = {"long": _prompt(90), "a": _prompt(5)[::-1], "b": _prompt(6)}
    alone = {rid: _generate(_runner(tiny), p, 8).output for rid, p in prompts.items()}
    d = Driver(_runner(tiny), shuffle_blocks=True)
    for rid, prompt in prompts.items():
        d.add(rid, prompt)
    d.run(8)
    assert {rid: seq.output for rid, seq in d.seqs.items()} == alone
