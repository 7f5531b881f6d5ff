"""A decoder served for embeddings (`runner="pooling"`) through a real engine core on a tiny
model built here: each input's last-token hidden state, normalised, as transformers computes it,
whether its prompt came in one step or in chunks; what such a model does not do refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from triode.actors import RequestError, SamplingParams, open_engine

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 81, 2], list(range(20, 90))]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the builder loads transformers: only where a tiny model is wanted
    from triode.gpu.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("pooling") / "tiny", architecture="qwen3", tokenizer_from="bytes"
    )


def _reference(model_dir: Path, prompt: list[int]) -> np.ndarray:
    # transformers is the reference the test compares against
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


ENGINE_ARGS = {
    "runner": "pooling",
    "dtype": "float32",
    "kv_cache_memory": "16MiB",
    "max_model_len": 256,
    # the long prompt is computed in three chunks
    "max_num_batched_tokens": 32,
    "max_new_prompt_tokens": 0,
}


async def test_a_decoder_embeds_its_last_token_as_transformers_does(tiny_model: Path) -> None:
    async with open_engine(str(tiny_model), **ENGINE_ARGS) as engine:
        assert engine.pooling is not None
        assert engine.pooling["task"] == "embed" and engine.pooling["pooling"] == "last"
        outputs = await engine.embed(PROMPTS)
        raw = await engine.embed(PROMPTS[:1], normalize=False)
        with pytest.raises(RequestError, match="pooling requests only"):
            async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(RequestError, match="Matryoshka"):
            await engine.embed(PROMPTS[:1], dimensions=8)
        with pytest.raises(RequestError, match="serves embeddings, not classify"):
            await engine.classify(PROMPTS[:1])
        with trio.fail_after(30):
            while engine.stats.kv_cache_usage or engine.stats.num_running_reqs:
                await trio.sleep(0.05)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.num_prompt_tokens == len(prompt)
        expected = _reference(tiny_model, prompt)
        assert out.data.dtype == np.float32 and out.data.shape == expected.shape
        np.testing.assert_allclose(out.data, expected, atol=2e-5)
        assert abs(float(np.linalg.norm(out.data)) - 1.0) < 1e-5
    assert abs(float(np.linalg.norm(raw[0].data)) - 1.0) > 1e-3  # not normalised when asked


async def test_a_generating_model_refuses_embeddings(tiny_model: Path) -> None:
    args = {k: v for k, v in ENGINE_ARGS.items() if k != "runner"}
    async with open_engine(str(tiny_model), **args) as engine:
        assert engine.pooling is None
        with pytest.raises(RequestError, match="generates text"):
            await engine.embed(PROMPTS[:1])
