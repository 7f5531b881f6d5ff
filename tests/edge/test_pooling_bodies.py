"""The pooling endpoints' bodies (edge/pooling/): what decodes and what is a 400 naming its
field, the caps on one request, the shapes clients parse; then the routes in-process over a stub
engine (tests/app_harness.py): keys, a text model's 400, the engine's refusals, the metrics."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from app_harness import StubEngine, call
from openai.types import CreateEmbeddingResponse

from triode.actors import EngineDeadError, RequestError, RequestRefused
from triode.edge.app import App
from triode.edge.auth import ApiKeys
from triode.edge.errors import APIError
from triode.edge.ignored_fields import HEADER
from triode.edge.pooling.request_bodies import (
    MAX_INPUTS,
    MAX_USER,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    check_dimensions,
    check_token_inputs,
    check_truncation,
    decode_pooling_request,
    max_pairs,
)
from triode.edge.pooling.response_bodies import (
    embedding_response,
    encode_vector,
    pooling_response,
    rerank_response,
    score_response,
)
from triode.edge.pooling.serving import NOT_SERVED_TYPE, POOLING_ROUTES
from triode.edge.settings import Settings

EMBED = {"task": "embed", "dimensions": 4, "normalize": True, "matryoshka": False,
         "pooling": "mean", "activation": "none", "labels": [], "max_seq_length": 256}  # fmt: skip
CLASSIFY = {**EMBED, "task": "classify", "dimensions": 2, "normalize": False,
            "activation": "softmax", "labels": ["no", "yes"]}  # fmt: skip


@dataclass
class Out:
    data: np.ndarray
    num_prompt_tokens: int


def _decode(kind: type[Any], **body: Any) -> Any:
    return decode_pooling_request(msgspec.json.encode(body), kind, None)


def _refused(kind: type[Any], **body: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        _decode(kind, **body)
    assert caught.value.status == 400
    return caught.value


# Decoding


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("a cat", ["a cat"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_input_shape_openai_allows_decodes_to_its_inputs(given: Any, inputs: Any) -> None:
    assert _decode(EmbeddingRequest, input=given).inputs() == inputs


@pytest.mark.parametrize("given", ["", [], [""], ["a", ""], [[]], [[1], []]])
def test_an_empty_input_is_a_400_naming_input(given: Any) -> None:
    assert _refused(EmbeddingRequest, input=given).param == "input"


@pytest.mark.parametrize("given", [["a", 1], [1, [2]], ["a", [1]], [-1], [[-5]], [1.5], {"a": 1}])
def test_mixed_or_wrong_inputs_are_a_400_naming_input(given: Any) -> None:
    assert (_refused(EmbeddingRequest, input=given).param or "").startswith("input")


def test_more_inputs_than_the_cap_is_a_400_that_names_the_cap() -> None:
    assert len(_decode(EmbeddingRequest, input=["x"] * MAX_INPUTS).inputs()) == MAX_INPUTS
    error = _refused(EmbeddingRequest, input=["x"] * (MAX_INPUTS + 1))
    assert str(MAX_INPUTS) in error.message and error.param == "input"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"dimensions": 0}, "dimensions"),
        ({"encoding_format": "bytes"}, "encoding_format"),
        ({"user": "u" * (MAX_USER + 1)}, "user"),
        ({"add_special_tokens": False}, "add_special_tokens"),
        ({"embed_dtype": "bfloat16"}, "embed_dtype"),
        ({"endianness": "middle"}, "endianness"),
        ({"normalize": "yes"}, "normalize"),
    ],
)
def test_out_of_range_fields_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert _refused(EmbeddingRequest, input="a", **fields).param == param


def test_minus_one_truncates_to_the_models_length_and_normalize_falls_back_to_activation() -> None:
    req = _decode(EmbeddingRequest, input="a", truncate_prompt_tokens=-1, use_activation=False)
    assert req.truncate_prompt_tokens == -1
    assert req.wants_normalized() is False
    assert _decode(EmbeddingRequest, input="a").wants_normalized() is None
    assert _decode(PoolingRequest, input="a", task="embed").task == "embed"


def test_a_single_text_1_is_scored_against_every_text_2() -> None:
    req = _decode(ScoreRequest, text_1="q", text_2=["a", "b", "c"])
    assert req.pairs() == (["q", "q", "q"], ["a", "b", "c"])
    req = _decode(ScoreRequest, text_1=["x", "y"], text_2=["a", "b"])
    assert req.pairs() == (["x", "y"], ["a", "b"])
    assert _decode(ScoreRequest, text_1=["q"], text_2="a").pairs() == (["q"], ["a"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ({"text_1": [], "text_2": ["a"]}, "text_1"),
        ({"text_1": "a", "text_2": []}, "text_2"),
        ({"text_1": "a"}, "text_2"),
        ({"text_1": "a", "text_2": ["x"] * (MAX_INPUTS + 1)}, "text_2"),
    ],
)
def test_score_lists_that_do_not_pair_are_a_400(body: dict[str, Any], param: str) -> None:
    assert _refused(ScoreRequest, **body).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": [{"text": "a"}]}, "documents[0]"),
        ({"documents": ["a"]}, "query"),
    ],
)
def test_bad_rerank_bodies_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert _refused(RerankRequest, **body).param == param


def test_rerank_returns_documents_by_default() -> None:
    req = _decode(RerankRequest, query="q", documents=["a", ""])
    assert (req.top_n, req.return_documents, req.documents) == (0, True, ["a", ""])


# Checks against the model


def test_token_ids_past_the_vocabulary_or_the_context_are_a_400() -> None:
    fits = dict(max_model_len=8, vocab_size=100, truncated=False)
    check_token_inputs(["text", [1, 2, 99]], **fits)
    with pytest.raises(APIError, match="item 1 has token ids past"):
        check_token_inputs(["text", [1, 100]], **fits)
    with pytest.raises(APIError, match="item 0 has 9 tokens"):
        check_token_inputs([[1] * 9], **fits)
    check_token_inputs([[1] * 9, [1] * 3], **{**fits, "truncated": True})  # the engine cuts it


def test_token_ids_in_all_are_capped_at_the_context_per_input_even_when_truncated() -> None:
    check_token_inputs([[1] * 10, [1] * 6], max_model_len=8, vocab_size=100, truncated=True)
    with pytest.raises(APIError, match="17 token ids in 2 inputs") as caught:
        check_token_inputs([[1] * 11, [1] * 6], max_model_len=8, vocab_size=100, truncated=True)
    assert caught.value.param == "input"


def test_truncation_past_the_context_is_a_400() -> None:
    check_truncation(None, 8)
    check_truncation(-1, 8)
    check_truncation(8, 8)
    with pytest.raises(APIError) as caught:
        check_truncation(9, 8)
    assert caught.value.param == "truncate_prompt_tokens"


def test_dimensions_are_checked_against_the_model() -> None:
    assert check_dimensions(None, EMBED) is None
    assert check_dimensions(4, EMBED) is None  # its own size asks nothing
    for dimensions, spec in ((5, EMBED), (2, EMBED), (9, {**EMBED, "matryoshka": True})):
        with pytest.raises(APIError) as caught:
            check_dimensions(dimensions, spec)
        assert caught.value.param == "dimensions"
    assert check_dimensions(2, {**EMBED, "matryoshka": True}) == 2


def test_an_embedding_model_scores_half_as_many_pairs_as_a_cross_encoder() -> None:
    assert max_pairs(EMBED) * 2 == max_pairs(CLASSIFY) == MAX_INPUTS


# Responses


def test_base64_is_the_float32_bytes_the_openai_client_decodes() -> None:
    vector = np.array([0.5, -1.25, 3.0], np.float32)
    assert encode_vector(vector) == [0.5, -1.25, 3.0]
    packed = base64.b64decode(encode_vector(vector, "base64", "little"))  # type: ignore[arg-type]
    assert np.frombuffer(packed, dtype="float32").tolist() == [0.5, -1.25, 3.0]
    packed = base64.b64decode(encode_vector(vector, "base64", "big"))  # type: ignore[arg-type]
    assert np.frombuffer(packed, dtype=">f4").tolist() == [0.5, -1.25, 3.0]


def test_an_embedding_response_parses_as_openais_and_counts_the_prompt_tokens() -> None:
    outputs = [Out(np.array([1.0, 0.0]), 3), Out(np.array([0.0, 1.0]), 4)]
    response = embedding_response(outputs, request_id="embd-1", model="m")
    parsed = CreateEmbeddingResponse.model_validate_json(msgspec.json.encode(response))
    assert [d.embedding for d in parsed.data] == [[1.0, 0.0], [0.0, 1.0]]
    assert [d.index for d in parsed.data] == [0, 1]
    assert (parsed.object, parsed.model, parsed.usage.prompt_tokens) == ("list", "m", 7)
    assert parsed.usage.total_tokens == 7
    pooled = msgspec.to_builtins(pooling_response(outputs, request_id="pool-1", model="m"))
    assert pooled["data"][1] == {"index": 1, "object": "pooling", "data": [0.0, 1.0]}


def test_scores_keep_the_pairs_order() -> None:
    outputs = [Out(np.array([0.25], np.float32), 5), Out(np.array([0.75], np.float32), 6)]
    body = msgspec.to_builtins(score_response(outputs, request_id="score-1", model="m"))
    assert body["object"] == "list" and body["id"] == "score-1"
    assert body["data"] == [
        {"index": 0, "object": "score", "score": 0.25},
        {"index": 1, "object": "score", "score": 0.75},
    ]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 11


def test_rerank_sorts_by_relevance_keeps_ties_in_order_and_takes_the_top_n() -> None:
    scores = [0.1, 0.9, 0.5, 0.9]
    outputs = [Out(np.array([s], np.float32), 2) for s in scores]
    docs = ["a", "b", "c", "d"]

    def results(**options: Any) -> list[dict[str, Any]]:
        options = {"top_n": 0, "return_documents": True, **options}
        response = rerank_response(outputs, docs, request_id="rerank-1", model="m", **options)
        body = msgspec.to_builtins(response)
        assert body["usage"] == {"total_tokens": 8}
        return body["results"]

    assert [r["index"] for r in results()] == [1, 3, 2, 0]
    assert [r["document"]["text"] for r in results(top_n=2)] == ["b", "d"]
    assert all("document" not in r for r in results(return_documents=False))
    assert results(top_n=10)[0]["relevance_score"] == pytest.approx(0.9)


# The routes, in-process


@dataclass
class PoolingStub(StubEngine):
    """Pools as a model of `pooling` would: each input's vector is its length then ones; a
    pair's score its texts' lengths' ratio. `calls` notes each call and its options; `raises`
    is raised instead."""

    pooling: dict[str, Any] | None = field(default_factory=lambda: dict(EMBED))
    calls: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)
    raises: BaseException | None = None

    def _answer(self, name: str, inputs: Any, options: dict[str, Any]) -> list[Out]:
        self.calls.append((name, inputs, options))
        if self.raises is not None:
            raise self.raises
        assert self.pooling is not None
        size = self.pooling["dimensions"]
        return [Out(np.array([len(x)] + [1] * (size - 1), np.float32), len(x)) for x in inputs]

    async def embed(self, inputs: list[Any], **options: Any) -> list[Out]:
        return self._answer("embed", inputs, options)

    async def classify(self, inputs: list[Any], **options: Any) -> list[Out]:
        return self._answer("classify", inputs, options)

    async def score(self, text_1: list[str], text_2: list[str], **options: Any) -> list[Out]:
        self._answer("score", (text_1, text_2), options)
        return [
            Out(np.array([len(a) / (len(b) or 1)], np.float32), len(a) + len(b))
            for a, b in zip(text_1, text_2, strict=True)
        ]


def _app(pooling: dict[str, Any] | None = EMBED, **settings: Any) -> App:
    engine = PoolingStub(pooling=None if pooling is None else dict(pooling))
    return App(engine, Settings(served_model_names=["m"], **settings))  # type: ignore[arg-type]


def _engine(app: App) -> PoolingStub:
    return app.engine  # type: ignore[return-value]


def _body(path: str) -> dict[str, Any]:
    """A body each route takes."""
    if path in ("/v1/embeddings", "/pooling"):
        return {"input": "hi"}
    if path.endswith("score"):
        return {"text_1": "a", "text_2": "b"}
    return {"query": "a", "documents": ["b"]}


@pytest.mark.parametrize("path", sorted(POOLING_ROUTES))
async def test_a_text_model_answers_every_pooling_route_with_a_400(path: str) -> None:
    answer = await call(_app(None), "POST", path, _body(path))
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["type"] == NOT_SERVED_TYPE and "does not serve" in error["message"]


@pytest.mark.parametrize("path", sorted(POOLING_ROUTES))
async def test_every_pooling_route_needs_the_key(path: str) -> None:
    app = _app(api_keys=ApiKeys(["k"]))
    assert (await call(app, "POST", path, _body(path))).status == 401
    assert (await call(app, "POST", path, _body(path), key="k")).status == 200
    assert (await call(app, "GET", path, key="k")).status == 405


async def test_embeddings_run_on_the_engine_with_the_requests_options() -> None:
    app = _app({**EMBED, "matryoshka": True})
    body = {"model": "m", "input": [[5, 6], [7, 8, 9]], "dimensions": 2, "normalize": False,
            "truncate_prompt_tokens": -1, "seed": 3}  # fmt: skip
    answer = await call(
        app, "POST", "/v1/embeddings", body, headers=[(b"x-data-parallel-rank", b"1")]
    )
    assert answer.status == 200, answer.body
    assert answer.headers[HEADER] == b"seed"
    parsed = CreateEmbeddingResponse.model_validate_json(answer.body)
    assert [d.embedding[0] for d in parsed.data] == [2.0, 3.0]
    assert parsed.usage.prompt_tokens == 5
    [(name, inputs, options)] = _engine(app).calls
    assert (name, inputs) == ("embed", [[5, 6], [7, 8, 9]])
    assert options["dimensions"] == 2 and options["normalize"] is False
    assert options["truncate_prompt_tokens"] == -1 and options["data_parallel_rank"] == 1
    assert options["request_id"] == parsed.id and parsed.id.startswith("embd-")
    metrics = app.metrics.render()[0].decode()
    assert 'triode:prompt_tokens_total{model_name="m"} 5.0' in metrics
    assert 'triode:request_success_total{finished_reason="stop",model_name="m"} 2.0' in metrics


async def test_a_classifier_serves_pooling_and_scores_but_no_embeddings() -> None:
    app = _app(CLASSIFY)
    answer = await call(app, "POST", "/v1/embeddings", {"input": "hi"})
    assert answer.status == 400 and "it classifies" in answer.json()["error"]["message"]
    answer = await call(app, "POST", "/pooling", {"input": ["abc"]})
    assert answer.status == 200 and answer.json()["data"][0]["data"] == [3.0, 1.0]
    assert _engine(app).calls[-1][0] == "classify"
    for fields in ({"dimensions": 1}, {"task": "embed"}, {"use_activation": False}):
        answer = await call(app, "POST", "/pooling", {"input": "hi", **fields})
        assert answer.status == 400 and answer.json()["error"]["param"] == next(iter(fields))


async def test_score_broadcasts_text_1_and_rerank_ranks_the_documents() -> None:
    app = _app()
    answer = await call(app, "POST", "/v1/score", {"text_1": "abcd", "text_2": ["ab", "abcd"]})
    assert [d["score"] for d in answer.json()["data"]] == [2.0, 1.0]
    assert _engine(app).calls[-1][1] == (["abcd", "abcd"], ["ab", "abcd"])
    body = {"query": "abcd", "documents": ["abcd", "a", "ab"], "top_n": 2}
    answer = await call(app, "POST", "/v2/rerank", body)
    ranked = answer.json()
    assert ranked["id"].startswith("rerank-")
    assert [(r["index"], r["document"]["text"]) for r in ranked["results"]] == [(1, "a"), (2, "ab")]
    too_many = {"text_1": "a", "text_2": ["b"] * (max_pairs(EMBED) + 1)}
    answer = await call(app, "POST", "/score", too_many)
    assert answer.status == 400 and answer.json()["error"]["param"] == "text_2"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RequestError("dimensions: not for this model"), 400),
        (RequestRefused("the queue is full", retry_after=2.5), 429),
        (EngineDeadError("gone"), 503),
        (RuntimeError("/secret/path exploded"), 500),
    ],
)
async def test_the_engines_refusals_are_answered_as_the_completions_are(
    error: BaseException, status: int
) -> None:
    app = _app()
    _engine(app).raises = error
    answer = await call(app, "POST", "/v1/embeddings", {"input": "hi"})
    assert answer.status == status
    assert "secret" not in answer.body.decode()
    if status == 429:
        assert answer.headers[b"retry-after"] == b"3"


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"{not json", 400), (b'{"input": "a", "dimensions": "2"}', 400), (b"x" * 2048, 413)],
)
async def test_malformed_or_oversized_bodies_are_refused_before_the_engine(
    body: bytes, status: int
) -> None:
    app = _app(max_body_size=1024)
    answer = await call(app, "POST", "/v1/embeddings", body)
    assert answer.status == status and "error" in answer.json()
    assert not _engine(app).calls
