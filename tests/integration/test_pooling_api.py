"""The pooling endpoints end to end: a real `triode serve` on an embedding model
(sentence-transformers' all-MiniLM-L6-v2: mean pooling, normalised, 384 dimensions), driven by
the official `openai` client for `/v1/embeddings` and by raw HTTP for `/pooling`, `/score` and
`/rerank`, its answers checked against the model run by transformers in this process.

The model's directory is `$TRIODE_EMBED_MODEL`, by default
`~/.cache/triode/models/all-MiniLM-L6-v2`; without it every test here is skipped."""

from __future__ import annotations

import base64
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from server import Server, running_server

pytestmark = pytest.mark.slow

MODEL_ENV = "TRIODE_EMBED_MODEL"
DEFAULT_MODEL = Path.home() / ".cache" / "triode" / "models" / "all-MiniLM-L6-v2"
KEY = "pool-key"
NAME = "minilm"
DIMENSIONS = 384
# float32: the answers are compared with sentence-transformers' float32 ones
SERVER_ARGS = ["--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", "16",
               "--max-body-size", "1MiB", "--dtype", "float32"]  # fmt: skip
AUTH = {"authorization": f"Bearer {KEY}"}
TEXTS = [
    "A cat sat on the mat.",
    "A kitten was sitting on the rug.",
    "The stock market fell sharply today.",
]


@pytest.fixture(scope="module")
def embed_model_dir() -> Path:
    path = Path(os.environ.get(MODEL_ENV) or DEFAULT_MODEL).expanduser()
    if not (path / "config.json").is_file():
        pytest.skip(f"no embedding model at {path} (set {MODEL_ENV} to one's directory)")
    return path


@pytest.fixture(scope="module")
def pooling_server(
    embed_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("pooling") / "serve.log"
    with running_server([str(embed_model_dir), *SERVER_ARGS], log) as server:
        yield server


@functools.cache
def _reference(model_dir: Path) -> tuple[Any, Any]:
    # transformers and torch only for the reference, and only when a model is there to run
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    return tokenizer, model


def reference_embeddings(model_dir: Path, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """sentence-transformers' answer: each text's last hidden states averaged over its
    tokens, L2-normalised; and each text's token count."""
    # only the reference needs torch
    import torch

    tokenizer, model = _reference(model_dir)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    normalised = torch.nn.functional.normalize(mean, dim=-1)
    return normalised.numpy(), batch["attention_mask"].sum(1).tolist()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _post(server: Server, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", AUTH)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    [line] = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_openai_client_embeddings_match_sentence_transformers(
    pooling_server: Server, embed_model_dir: Path
) -> None:
    response = _client(pooling_server).embeddings.create(model=NAME, input=TEXTS)
    got = np.array([d.embedding for d in response.data], np.float32)
    expected, tokens = reference_embeddings(embed_model_dir, TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    assert got.shape == (3, DIMENSIONS)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
    assert np.all(np.sum(got * expected, axis=1) >= 0.99999)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(tokens)
    assert response.model == NAME


def test_float_and_base64_answers_carry_the_same_vectors(pooling_server: Server) -> None:
    floats = _post(pooling_server, "/v1/embeddings", {"input": TEXTS[0]}).json()
    packed = _post(
        pooling_server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}
    ).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, floats["data"][0]["embedding"], rtol=0, atol=1e-6)


def test_token_ids_embed_as_their_text_does(pooling_server: Server, embed_model_dir: Path) -> None:
    tokenizer, _ = _reference(embed_model_dir)
    ids = [tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    by_ids = _client(pooling_server).embeddings.create(model=NAME, input=ids)
    by_text = _client(pooling_server).embeddings.create(model=NAME, input=TEXTS[:2])
    for a, b in zip(by_ids.data, by_text.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    assert by_ids.usage.prompt_tokens == sum(len(x) for x in ids)


def test_pooling_answers_the_embeddings(pooling_server: Server) -> None:
    pooled = _post(pooling_server, "/pooling", {"model": NAME, "input": TEXTS[:2]}).json()
    embedded = _post(pooling_server, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    for p, e in zip(pooled["data"], embedded["data"], strict=True):
        np.testing.assert_allclose(p["data"], e["embedding"], atol=1e-6)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_similarity_of_the_embeddings(
    pooling_server: Server, embed_model_dir: Path, path: str
) -> None:
    answer = _post(pooling_server, path, {"model": NAME, "text_1": TEXTS[0], "text_2": TEXTS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    expected, tokens = reference_embeddings(embed_model_dir, TEXTS)
    scores = [d["score"] for d in body["data"]]
    np.testing.assert_allclose(scores, expected @ expected[0], atol=1e-3)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 3 * tokens[0] + sum(tokens)
    pairwise = _post(pooling_server, path, {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose(
        [d["score"] for d in pairwise["data"]],
        [expected[0] @ expected[1], expected[1] @ expected[2]],
        atol=1e-3,
    )


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_puts_the_relevant_document_first(pooling_server: Server, path: str) -> None:
    documents = ["Bananas are yellow.", "Paris is the capital of France.", "Stocks fell."]
    body = {"model": NAME, "query": "What is the capital of France?", "documents": documents}
    ranked = _post(pooling_server, path, body).json()
    assert ranked["id"].startswith("rerank-") and ranked["model"] == NAME
    results = ranked["results"]
    assert results[0]["index"] == 1
    assert results[0]["document"] == {"text": documents[1]}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3
    assert ranked["usage"]["total_tokens"] > 0
    [top] = _post(pooling_server, path, {**body, "top_n": 1, "return_documents": False}).json()[
        "results"
    ]
    assert top["index"] == 1 and "document" not in top


def test_truncation_keeps_the_first_tokens(pooling_server: Server, embed_model_dir: Path) -> None:
    tokenizer, _ = _reference(embed_model_dir)
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = tokenizer(text)["input_ids"]
    kept = [*ids[:7], ids[-1]]  # the first tokens, the closing special token kept
    cut = _post(pooling_server, "/v1/embeddings", {"input": text, "truncate_prompt_tokens": 8})
    whole = _post(pooling_server, "/v1/embeddings", {"input": [kept]})
    assert cut.json()["usage"]["prompt_tokens"] == 8
    np.testing.assert_allclose(
        cut.json()["data"][0]["embedding"], whole.json()["data"][0]["embedding"], atol=1e-5
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["x"] * 2049}, "input"),
        ("/v1/embeddings", {"input": "x", "dimensions": 100}, "dimensions"),
        ("/v1/embeddings", {"input": [[10**9]]}, "input"),
        (
            "/v1/embeddings",
            {"input": "x", "truncate_prompt_tokens": 10**6},
            "truncate_prompt_tokens",
        ),
        ("/v1/embeddings", {"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/pooling", {"input": "x", "task": "classify"}, "task"),
    ],
)
def test_bad_requests_are_a_400_in_openais_shape(
    pooling_server: Server, path: str, body: dict[str, Any], param: str | None
) -> None:
    answer = _post(pooling_server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def test_an_input_longer_than_the_model_takes_is_a_400(pooling_server: Server) -> None:
    answer = _post(pooling_server, "/v1/embeddings", {"input": "word " * 2000})
    assert answer.status_code == 400, answer.text


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/score", "/rerank"])
def test_every_pooling_route_needs_the_key(pooling_server: Server, path: str) -> None:
    answer = _post(pooling_server, path, {"input": "x"}, headers={})
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"] == "Bearer"


def test_pooling_requests_count_in_the_metrics(pooling_server: Server) -> None:
    before = _metric(pooling_server, "triode:prompt_tokens_total")
    usage = _post(pooling_server, "/v1/embeddings", {"input": TEXTS}).json()["usage"]
    assert _metric(pooling_server, "triode:prompt_tokens_total") == before + usage["prompt_tokens"]
    assert _metric(pooling_server, "vllm:prompt_tokens_total") == before + usage["prompt_tokens"]


def test_the_openai_client_reads_a_refusal_as_a_bad_request(pooling_server: Server) -> None:
    with pytest.raises(openai.BadRequestError):
        _client(pooling_server).embeddings.create(model=NAME, input="x", dimensions=10_000)
