"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral end to end: tiny random-weight checkpoints made here
with transformers' own classes, served by `triode serve` and run through the embedding API,
checked token for token (and logprob for logprob) against transformers on the same files.

Every family has a sliding window shorter than the prompts (Gemma 3 on its sliding layers only),
so the answers also check the window's masking in the prefill, in the prefix-cached
continuation and in the decodes past it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import trio
from engine_calls import final_output
from reference import Reference
from server import running_servers

from triode.actors import SamplingParams, open_engine
from triode.gpu.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

WINDOW = 16
NEW_TOKENS = 20
FAMILIES = {
    "qwen3": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 30.0,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "sliding_window": WINDOW,
        "use_sliding_window": True,
        "max_window_layers": 0,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
}
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as her father had taught her, and lit the lamp"
)
# a second prompt sharing the first's opening blocks: served from the prefix cache, its new
# tokens attend across the window's edge into the cached ones
SHARED = PROMPT + " while the storm gathered over the grey water beyond the harbour wall"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: build_tiny_model(
            root / name, architecture=name, num_layers=3, seed=3, initializer_range=0.1, **fields
        )  # type: ignore[arg-type]
        for name, fields in FAMILIES.items()
    }


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in models.items()}


def _check(reference: Reference, prompt_ids: list[int], tokens: list[int], logprobs) -> None:  # type: ignore[no-untyped-def]
    """`tokens` are transformers' greedy tokens and each logprob its log-softmax, within 1e-4."""
    assert len(prompt_ids) > WINDOW
    assert tokens == reference.greedy(tuple(prompt_ids), NEW_TOKENS)
    expected = reference.log_softmax(prompt_ids + tokens)[len(prompt_ids) - 1 : -1]
    want = [float(expected[i, t]) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(logprobs, want, atol=1e-4, rtol=0)


def test_served_families_match_transformers(
    models: dict[str, Path], references: dict[str, Reference], tmp_path: Path
) -> None:
    specs = [
        ([str(path), "--dtype", "float32", "--max-model-len", "256"], tmp_path / f"{n}.log", None)
        for n, path in models.items()
    ]
    with running_servers(*specs) as servers:
        for (name, _), server in zip(models.items(), servers, strict=True):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            reference = references[name]
            served = client.models.list().data[0].id
            for text in (PROMPT, SHARED):
                prompt_ids = reference.encode(text)
                answer = client.completions.create(
                    model=served,
                    prompt=prompt_ids,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    logprobs=1,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                )
                choice = answer.choices[0]
                assert choice.logprobs is not None, name
                tokens = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
                _check(reference, prompt_ids, tokens, choice.logprobs.token_logprobs)
            # the second prompt reused the first's full blocks
            assert answer.usage.prompt_tokens_details is not None
            assert answer.usage.prompt_tokens_details.cached_tokens, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_embedded_engine_matches_transformers(
    family: str, models: dict[str, Path], references: dict[str, Reference]
) -> None:
    reference = references[family]
    prompts = [reference.encode(PROMPT), reference.encode(SHARED)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

    async def main() -> list:  # type: ignore[type-arg]
        async with open_engine(
            model=str(models[family]), dtype="float32", max_model_len=256
        ) as engine:
            return [await final_output(engine, p, params) for p in prompts]

    outputs = trio.run(main)
    for prompt_ids, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        _check(
            reference,
            prompt_ids,
            list(completion.token_ids),
            [entry.logprob for entry in completion.logprobs],
        )
    assert outputs[1].num_cached_tokens  # the second prompt reused the first's full blocks
