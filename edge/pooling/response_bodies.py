"""The response bodies of the pooling endpoints, as msgspec Structs with OpenAI's and vLLM's
names, and their making from the engine's pooled outputs.

A vector goes out as a JSON list of floats, or (`encoding_format: base64`) as the base64 of its
float32 bytes, little-endian unless asked otherwise: what the openai client asks for by default
and decodes with numpy's `frombuffer`.
"""

from __future__ import annotations

import base64
import sys
import time
from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec
import numpy as np

from ..completions.response_bodies import UsageInfo

_ORDER = {"little": "<", "big": ">", "native": "<" if sys.byteorder == "little" else ">"}


class Pooled(Protocol):
    """What the engine answers for one input (or one scored pair)."""

    @property
    def data(self) -> np.ndarray: ...
    @property
    def num_prompt_tokens(self) -> int: ...


def _now() -> int:
    return int(time.time())


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int = msgspec.field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int = msgspec.field(default_factory=_now)
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["list"] = "list"
    created: int = msgspec.field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    # left out with `return_documents: false`, as Cohere leaves it out
    document: RerankDocument | msgspec.UnsetType = msgspec.UNSET
    relevance_score: float


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def encode_vector(
    data: np.ndarray,
    encoding_format: Literal["float", "base64"] = "float",
    endianness: Literal["native", "little", "big"] = "native",
) -> list[float] | str:
    """A vector as it goes out: a list of floats, or the base64 of its float32 bytes."""
    if encoding_format == "float":
        return np.asarray(data, np.float32).tolist()
    packed = np.asarray(data, _ORDER[endianness] + "f4").tobytes()
    return base64.b64encode(packed).decode("ascii")


def usage_of(outputs: Sequence[Pooled]) -> UsageInfo:
    """The token counts of an answer: its inputs' prompt tokens, nothing generated."""
    tokens = sum(out.num_prompt_tokens for out in outputs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def embedding_response(
    outputs: Sequence[Pooled],
    *,
    request_id: str,
    model: str,
    encoding_format: Literal["float", "base64"] = "float",
    endianness: Literal["native", "little", "big"] = "native",
) -> EmbeddingResponse:
    data = [
        EmbeddingData(index=i, embedding=encode_vector(out.data, encoding_format, endianness))
        for i, out in enumerate(outputs)
    ]
    return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage_of(outputs))


def pooling_response(
    outputs: Sequence[Pooled],
    *,
    request_id: str,
    model: str,
    encoding_format: Literal["float", "base64"] = "float",
    endianness: Literal["native", "little", "big"] = "native",
) -> PoolingResponse:
    data = [
        PoolingData(index=i, data=encode_vector(out.data, encoding_format, endianness))
        for i, out in enumerate(outputs)
    ]
    return PoolingResponse(id=request_id, model=model, data=data, usage=usage_of(outputs))


def score_response(outputs: Sequence[Pooled], *, request_id: str, model: str) -> ScoreResponse:
    data = [ScoreData(index=i, score=_score(out)) for i, out in enumerate(outputs)]
    return ScoreResponse(id=request_id, model=model, data=data, usage=usage_of(outputs))


def rerank_response(
    outputs: Sequence[Pooled],
    documents: Sequence[str],
    *,
    top_n: int,
    return_documents: bool,
    request_id: str,
    model: str,
) -> RerankResponse:
    """The documents by relevance, best first (ties in their given order), the best `top_n`
    of them (0: all)."""
    scores = [_score(out) for out in outputs]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=documents[i]) if return_documents else msgspec.UNSET,
            relevance_score=scores[i],
        )
        for i in order
    ]
    usage = RerankUsage(total_tokens=sum(out.num_prompt_tokens for out in outputs))
    return RerankResponse(id=request_id, model=model, usage=usage, results=results)


def _score(out: Pooled) -> float:
    """A pair's score: the one float of its output."""
    return float(np.asarray(out.data).reshape(-1)[0])
