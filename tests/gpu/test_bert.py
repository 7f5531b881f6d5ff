"""BERT encoders (`models.bert`, `EncoderRunner`) against transformers' BertModel and
BertForSequenceClassification, and against sentence-transformers' SentenceTransformer and
CrossEncoder on the same inputs."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

from triode.gpu.encoder_runner import EncoderRunner
from triode.gpu.models.architectures import CheckpointMismatch
from triode.gpu.models.bert import attention_groups, load_encoder, pool
from triode.wire import (
    NewRequestData,
    PoolingParams,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)

WORDS = (
    "the a cat dog sat on mat rain fell over city streets at night quick brown fox jumps lazy "
    "river mountain green house bright morning question answer search engine vector"
).split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
EMBED_MODEL = Path(
    os.environ.get("TRIODE_EMBED_MODEL", "~/.cache/triode/models/all-MiniLM-L6-v2")
).expanduser()


def _tiny(path: Path, architecture: str, **overrides: object) -> tuple[Path, torch.nn.Module]:
    """A random BERT of `architecture` saved with a tokenizer of `VOCAB`; also the
    transformers model it was saved from."""
    torch.manual_seed(0)
    settings = {
        "vocab_size": len(VOCAB),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "max_position_embeddings": 256,
        # weights large enough that the activation functions differ in what they give
        "initializer_range": 0.2,
        "architectures": [architecture],
    }
    config = BertConfig(**{**settings, **overrides})
    cls = BertModel if architecture == "BertModel" else BertForSequenceClassification
    model = cls(config).eval()
    model.save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return path, model


def _batch(lengths: list[int], pair: bool) -> tuple[torch.Tensor, ...]:
    """Random input ids right-padded to the longest of `lengths`, segment ids (1 for each
    sequence's second half where `pair`), and the mask of real tokens."""
    generator = torch.Generator().manual_seed(1)
    length = max(lengths)
    ids = torch.randint(5, len(VOCAB), (len(lengths), length), generator=generator)
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    ids[~mask] = 0
    types = torch.zeros_like(ids)
    if pair:
        for i, n in enumerate(lengths):
            types[i, n // 2 : n] = 1
    return ids, types, mask


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
@pytest.mark.parametrize("pair", [False, True])
def test_hidden_states_equal_transformers_over_a_padded_batch(
    tmp_path: Path, pair: bool, hidden_act: str
) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel", hidden_act=hidden_act)
    ids, types, mask = _batch([7, 12, 1, 3, 12], pair)
    ours = load_encoder(model_dir, reference.config, torch.float32, "cpu")
    with torch.inference_mode():
        want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
        got = ours(ids, types, mask)
    assert got.shape == want.last_hidden_state.shape
    torch.testing.assert_close(got[mask], want.last_hidden_state[mask], atol=1e-5, rtol=1e-5)


def test_pooling_takes_the_mean_the_first_or_the_last_real_token() -> None:
    hidden = torch.arange(2 * 4 * 3, dtype=torch.bfloat16).view(2, 4, 3)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    mean = pool(hidden, mask, "mean")
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, torch.tensor([[3.0, 4.0, 5.0], [16.5, 17.5, 18.5]]))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0].float())
    torch.testing.assert_close(pool(hidden, mask, "last"), hidden[[0, 1], [2, 3]].float())
    with pytest.raises(ValueError, match="max"):
        pool(hidden, mask, "max")


def test_sequences_of_far_apart_lengths_attend_in_groups_and_equal_transformers(
    tmp_path: Path,
) -> None:
    lengths = [200, 150, 149, 60, 40, 33, 5, 1, 200]
    groups = attention_groups(torch.tensor(lengths))
    assert len(groups) > 1
    # every real token is attended from exactly one group
    rows = torch.cat([g.rows for g in groups if g.rows is not None]).sort().values
    assert torch.equal(rows, torch.arange(sum(lengths)))
    model_dir, reference = _tiny(tmp_path, "BertModel")
    ids, types, mask = _batch(lengths, pair=True)
    ours = load_encoder(model_dir, reference.config, torch.float32, "cpu")
    with torch.inference_mode():
        want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
        got = ours(ids, types, mask)
    torch.testing.assert_close(got[mask], want.last_hidden_state[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pair", [False, True])
def test_classifier_logits_equal_transformers(tmp_path: Path, pair: bool) -> None:
    model_dir, reference = _tiny(tmp_path, "BertForSequenceClassification", num_labels=3)
    ids, types, mask = _batch([9, 4, 16, 2], pair)
    ours = load_encoder(model_dir, reference.config, torch.float32, "cpu")
    with torch.inference_mode():
        want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask.long()).logits
        got = ours(ids, types, mask)
    assert got.dtype == torch.float32 and got.shape == (4, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_agrees_with_float32_transformers_to_its_rounding(tmp_path: Path) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel")
    ids, types, mask = _batch([7, 12, 1, 3], pair=True)
    ours = load_encoder(model_dir, reference.config, torch.bfloat16, "cpu")
    with torch.inference_mode():
        want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
        got = pool(ours(ids, types, mask), mask, "mean")
    want = pool(want.last_hidden_state, mask, "mean")
    cosine = torch.nn.functional.cosine_similarity(got, want)
    assert got.dtype == torch.float32
    assert cosine.min() > 0.999, cosine


def test_weights_load_from_pytorch_model_bin_and_with_the_bert_prefix(tmp_path: Path) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel")
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    torch.save({f"bert.{name}": t for name, t in tensors.items()}, model_dir / "pytorch_model.bin")
    ids, types, mask = _batch([5, 3], pair=False)
    ours = load_encoder(model_dir, reference.config, torch.float32, "cpu")
    with torch.inference_mode():
        want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask.long())
        torch.testing.assert_close(ours(ids, types, mask)[mask], want.last_hidden_state[mask])


@pytest.mark.parametrize("damage", ["missing", "mis-shaped"])
def test_a_checkpoint_without_a_tensor_is_refused_by_name(tmp_path: Path, damage: str) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel")
    tensors = load_file(model_dir / "model.safetensors")
    name = "encoder.layer.1.attention.self.value.weight"
    if damage == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(CheckpointMismatch, match=name):
        load_encoder(model_dir, reference.config, torch.float32, "cpu")


def test_an_unsupported_activation_is_refused_by_name(tmp_path: Path) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel", hidden_act="relu")
    with pytest.raises(ValueError, match="relu"):
        load_encoder(model_dir, reference.config, torch.float32, "cpu")


def _request(
    request_id: str, ids: list[int], task: str = "embed", boundary: int = 0, **fields: object
) -> ScheduledRequest:
    params = PoolingParams(task=task, pair_boundary=boundary)
    new = NewRequestData(ids, SamplingParams(), pooling_params=params)
    return ScheduledRequest(request_id, ids, 0, [], new=new, **fields)  # type: ignore[arg-type]


def _pooled(runner: EncoderRunner, requests: list[ScheduledRequest]) -> np.ndarray:
    out = runner.execute(SchedulerOutput(step=3, requests=requests))
    assert out.step == 3
    assert [r.request_id for r in out.results] == [r.request_id for r in requests]
    assert all(r.pooled is not None and r.pooled.dtype == np.float32 for r in out.results)
    return np.stack([r.pooled for r in out.results])  # type: ignore[misc]


def test_the_runner_mean_pools_each_prompt_with_its_pair_segments(tmp_path: Path) -> None:
    model_dir, reference = _tiny(tmp_path, "BertModel")
    runner = EncoderRunner(model_dir, dtype="float32", device="cpu", num_threads=1)
    prompts = [[2, 7, 3], [2, 7, 8, 9, 3, 10, 11, 3], [2, 5, 3, 6, 3]]
    boundaries = [0, 5, 3]
    pairs = zip(prompts, boundaries, strict=True)
    got = _pooled(runner, [_request(f"r{i}", p, boundary=b) for i, (p, b) in enumerate(pairs)])
    for prompt, boundary, row in zip(prompts, boundaries, got, strict=True):
        ids = torch.tensor([prompt])
        types = (torch.arange(len(prompt)) >= boundary).long()[None] if boundary else None
        with torch.inference_mode():
            want = reference(input_ids=ids, token_type_ids=types).last_hidden_state.mean(1)[0]
        torch.testing.assert_close(torch.from_numpy(row), want, atol=1e-5, rtol=1e-5)


def test_the_runner_reports_its_geometry_and_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    model_dir, _ = _tiny(tmp_path, "BertModel")
    runner = EncoderRunner.from_engine_args(
        {"model": str(model_dir), "dtype": "float32", "block_size": 16, "max_model_len": 100,
         "max_num_batched_tokens": 512, "max_num_seqs": 8, "seed": 0},
        device="cpu", num_threads=1,
    )  # fmt: skip
    assert runner.num_kv_blocks == 2 * (512 // 16 + 8)
    assert runner.max_model_len == 100 and runner.eos_token_id is None
    assert runner.dtype == torch.float32 and runner.pooling_spec.task == "embed"
    assert _pooled(runner, [_request("a", [2, 7, 3])]).shape == (1, 32)
    chunk = _request("chunked", [2, 7, 8, 3])
    chunk.token_ids = [2, 7]
    later = _request("later-chunk", [2, 7, 8, 3])
    later.num_computed_tokens = 2
    refused = [
        chunk,
        later,
        _request("no-sample", [2, 3], sample=False),
        ScheduledRequest("not-new", [2, 3], 0, []),
        _request("wrong-task", [2, 3], task="classify"),
        _request("too-long", [5] * 101),
    ]
    for bad in refused:
        with pytest.raises(ValueError, match=bad.request_id):
            runner.execute(SchedulerOutput(step=1, requests=[_request("ok", [2, 3]), bad]))


def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(tmp_path: Path) -> None:
    cross_encoder = pytest.importorskip("sentence_transformers").CrossEncoder
    model_dir, _ = _tiny(tmp_path, "BertForSequenceClassification", num_labels=1)
    rng = random.Random(2)
    pairs = [
        (" ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
         " ".join(rng.choices(WORDS, k=rng.randint(1, 30))))
        for _ in range(24)
    ]  # fmt: skip
    want = cross_encoder(str(model_dir), device="cpu").predict(pairs)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    runner = EncoderRunner(model_dir, dtype="float32", device="cpu", num_threads=1)
    assert runner.pooling_spec.activation == "sigmoid"
    requests = []
    for i, (query, document) in enumerate(pairs):
        encoding = tokenizer.encode(query, document)
        boundary = encoding.type_ids.index(1)
        requests.append(_request(f"pair-{i}", encoding.ids, "classify", boundary))
    scores = 1 / (1 + np.exp(-_pooled(runner, requests)[:, 0]))
    np.testing.assert_allclose(scores, want, atol=1e-5)


def _sentences(count: int) -> list[str]:
    """Varied English-like sentences: one word to a few hundred tokens, punctuation, digits,
    case, and words the vocabulary splits into pieces."""
    rng = random.Random(0)
    extra = ["Paris", "2024", "naïve", "embeddings", "unbelievably", "COVID-19", "e-mail", "?"]
    sentences = []
    for i in range(count):
        words = rng.choices(WORDS + extra, k=rng.choice([1, 3, 8, 20, 60]) if i % 50 else 180)
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "", "?"]))
    return sentences


def test_minilm_embeddings_equal_sentence_transformers(tmp_path: Path) -> None:
    if not (EMBED_MODEL / "model.safetensors").is_file():
        pytest.skip(f"no all-MiniLM-L6-v2 at {EMBED_MODEL} (set TRIODE_EMBED_MODEL)")
    sentence_transformer = pytest.importorskip("sentence_transformers").SentenceTransformer
    sentences = _sentences(200)
    want = sentence_transformer(str(EMBED_MODEL), device="cpu").encode(sentences)
    runner = EncoderRunner(EMBED_MODEL, dtype="float32", device="cpu", num_threads=2)
    spec = runner.pooling_spec
    assert (spec.pooling, spec.normalize, spec.dimensions) == ("mean", True, 384)
    tokenizer = Tokenizer.from_file(str(EMBED_MODEL / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128 and truncates there, not at max_seq_length
    tokenizer.enable_truncation(runner.max_model_len)
    encodings = tokenizer.encode_batch(sentences)
    assert max(len(e.ids) for e in encodings) > 128
    got = []
    for lo in range(0, len(encodings), 32):
        requests = [_request(f"s{lo + i}", e.ids) for i, e in enumerate(encodings[lo : lo + 32])]
        got.append(_pooled(runner, requests))
    embeddings = np.concatenate(got)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    cosine = (embeddings * want).sum(1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999, cosine.min()
