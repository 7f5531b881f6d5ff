"""A decoder served for embeddings (`runner="pooling"`) through a real engine core on a tiny
model built here: each input's last-token hidden state, normalised, as transformers computes it,
whether its prompt came in one step or in chunks; what such a model does not do refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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
        # each request was finished, its blocks freed, before its output left the engine core
        stats = await engine.get_stats()
        assert stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0
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


WORDS = "the a cat dog sat on mat rain fell over city streets quick brown fox river".split()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random BERT cross-encoder (one label) with a tokenizer of its own words."""
    # transformers writes the checkpoint the engine and sentence-transformers both read
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    path = tmp_path_factory.mktemp("cross") / "encoder"
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=32, initializer_range=0.2, num_labels=1,
        architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    BertForSequenceClassification(config).eval().save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return path


async def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(
    cross_encoder: Path,
) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    queries = ["the cat sat", "a dog", "quick brown fox over the river"]
    documents = ["the cat sat on the mat", "rain fell over city streets", "a quick fox"]
    pairs = [(q, d) for q in queries for d in documents] * 20
    want = sentence_transformers.CrossEncoder(str(cross_encoder), device="cpu").predict(pairs)
    # a step holds two or three pairs: 180 make a backlog, and steps overlap
    args = {"dtype": "float32", "max_num_batched_tokens": 32}
    async with open_engine(str(cross_encoder), **args) as engine:
        assert engine.pooling is not None and engine.pooling["task"] == "classify"
        scores = await engine.score([q for q, _ in pairs], [d for _, d in pairs])
        assert (await engine.get_stats())["overlapped_steps"] > 0
        # cut to 8 tokens in all: the longer text loses tokens first, [CLS] and both [SEP] stay
        cut = await engine.score(["the cat sat on the mat"], ["a dog"], truncate_prompt_tokens=8)
        with pytest.raises(RequestError, match="serves classification"):
            await engine.embed(["the cat"])
        with pytest.raises(RequestError, match="pooling requests only"):
            async for _ in engine.generate("the cat", SamplingParams(max_tokens=2)):
                pass
    got = np.array([s.data[0] for s in scores])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert cut[0].num_prompt_tokens == 8
    expected_cut = sentence_transformers.CrossEncoder(
        str(cross_encoder), device="cpu", max_length=8
    ).predict([("the cat sat on the mat", "a dog")])
    np.testing.assert_allclose(cut[0].data, expected_cut, atol=1e-5)
