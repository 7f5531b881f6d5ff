"""The request bodies of the pooling endpoints (`/v1/embeddings`, `/pooling`, `/score`,
`/rerank`), as msgspec Structs, and the checks of what they ask against the served model.

Shapes and ranges are checked at decode, every failure a 400 naming the field. As on the other
OpenAI endpoints, top-level fields triode does not know are accepted, ignored and named in the
response (`edge/ignored_fields.py`); vLLM's fields that would change the answer are declared,
and refused when set to what triode does not do (`unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta

from triode.actors import out_of_vocabulary

from ..errors import APIError
from ..http import Request
from ..ignored_fields import decode_request_body

# OpenAI's cap on the inputs of one embeddings request; each input is one request in the
# engine core's queue, and every output is held until the last one is done.
MAX_INPUTS: Final = 2048
# `user` names an end user for abuse monitoring; triode keeps nothing of it, and no such id
# needs more.
MAX_USER: Final = 256

PoolingInput = str | list[int]
_TokenId = Annotated[int, Meta(ge=0)]
_KINDS: Final = "must be a string, a list of strings, a list of token ids or a list of those lists"


class PoolingBody(msgspec.Struct, kw_only=True):
    """What every pooling request shares: the model, the caller and prompt truncation."""

    model: str | None = None
    user: Annotated[str, Meta(max_length=MAX_USER)] | None = None
    # keep the first k tokens of a longer input; -1: as many as the model takes
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    priority: int = 0  # vLLM's; accepted and ignored: the scheduler serves in arrival order
    # Declared, refused when set to what triode does not do (see `unsupported`).
    add_special_tokens: bool = True
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        _check(
            self.truncate_prompt_tokens != 0,
            "truncate_prompt_tokens",
            "must be -1 (the model's maximum length) or at least 1",
        )

    def unsupported(self) -> None:
        """Raise a 400 `APIError` naming the first field set to what triode does not do."""
        if not self.add_special_tokens:
            raise APIError(
                400,
                "add_special_tokens: inputs without the model's special tokens are not supported",
                param="add_special_tokens",
            )


class EmbeddingRequest(PoolingBody, kw_only=True):
    """A `POST /v1/embeddings` body (OpenAI's, with vLLM's extra fields).

    `input`: a string, a list of strings, a list of token ids, or a list of token id lists;
    each string or list is one input. `normalize` (vLLM's, as `use_activation` is for an
    embedding model): None does as the model does.
    """

    input: str | list[str | _TokenId | list[_TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    normalize: bool | None = None
    # how base64 packs the floats (vLLM's fields): float32 only, in either byte order
    embed_dtype: str = "float32"
    endianness: Literal["native", "little", "big"] = "native"

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.input
        if isinstance(value, list):
            _check(len({type(v) for v in value}) <= 1, "input", _KINDS)
        inputs = self.inputs()
        _check(bool(inputs), "input", "must not be empty")
        for i, item in enumerate(inputs):
            _check(bool(item), "input", f"item {i} is empty; every input needs text or tokens")
        _check(
            len(inputs) <= MAX_INPUTS,
            "input",
            f"{len(inputs)} inputs; this server takes at most {MAX_INPUTS} in one request",
        )

    def unsupported(self) -> None:
        super().unsupported()
        if self.embed_dtype != "float32":
            raise APIError(
                400,
                f"embed_dtype: only float32 is supported, not {self.embed_dtype!r}",
                param="embed_dtype",
            )

    def inputs(self) -> list[PoolingInput]:
        """The inputs, in order: texts, or token id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]

    def wants_normalized(self) -> bool | None:
        """Whether the embeddings are to be L2-normalised; None: as the model does."""
        return self.normalize if self.normalize is not None else self.use_activation


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """A `POST /pooling` body (vLLM's): an embedding model's embeddings, a classifier's
    probabilities. `task`, when given, must be the one the model serves."""

    task: str | None = None


class ScoreRequest(PoolingBody, kw_only=True):
    """A `POST /score` body (vLLM's): `text_1[i]` scored against `text_2[i]`, or a single
    `text_1` against every `text_2`."""

    text_1: str | list[str]
    text_2: str | list[str]

    def __post_init__(self) -> None:
        super().__post_init__()
        first, second = _listed(self.text_1), _listed(self.text_2)
        _check(bool(first), "text_1", "must not be empty")
        _check(bool(second), "text_2", "must not be empty")
        _check(
            len(first) in (1, len(second)),
            "text_2",
            f"{len(second)} texts for {len(first)} in text_1: give one text_1 for all of them, "
            "or one each",
        )
        _check(
            len(second) <= MAX_INPUTS,
            "text_2",
            f"{len(second)} pairs; this server takes at most {MAX_INPUTS} in one request",
        )

    def pairs(self) -> tuple[list[str], list[str]]:
        """The pairs to score: the first texts (one given for all, repeated) and the second."""
        first, second = _listed(self.text_1), _listed(self.text_2)
        return (first * len(second) if len(first) == 1 else first), second


class RerankRequest(PoolingBody, kw_only=True):
    """A `POST /rerank` body (Jina's and Cohere's, as vLLM serves it): the `documents` ranked
    by relevance to the `query`, the best `top_n` of them (0: all)."""

    query: str
    documents: list[str]
    top_n: Annotated[int, Meta(ge=0)] = 0
    return_documents: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(bool(self.documents), "documents", "must not be empty")
        _check(
            len(self.documents) <= MAX_INPUTS,
            "documents",
            f"{len(self.documents)} documents; this server takes at most {MAX_INPUTS} in one "
            "request",
        )


_BodyT = TypeVar("_BodyT", bound=PoolingBody)


def decode_pooling_request(body: bytes, kind: type[_BodyT], http: Request | None) -> _BodyT:
    """Decode and validate a JSON body; any failure raises a 400 `APIError` naming the field.
    The top-level fields it ignored are announced on `http`'s response."""
    request = decode_request_body(body, kind, http)
    request.unsupported()
    return request


def check_truncation(truncate: int | None, max_model_len: int) -> None:
    """A 400 for a `truncate_prompt_tokens` past what the model takes."""
    if truncate is not None and truncate > max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens: {truncate} is more than the model takes, {max_model_len}",
            param="truncate_prompt_tokens",
        )


def check_token_inputs(
    inputs: list[PoolingInput], *, max_model_len: int, vocab_size: int, truncated: bool
) -> None:
    """A 400 for inputs given as token ids that the model cannot take: an id past its
    vocabulary (it would fail the whole step it ran in), an input longer than the model takes
    unless the request truncates it, or more ids in all than `max_model_len` per input.

    The last bounds what a truncating request makes the edge hold: the body limit bounds its
    bytes, but at two bytes an id ("0,") a 16 MiB body is 8M ids, 64 MiB as Python lists, for
    at most `max_model_len` ids of work per input."""
    total = 0
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            continue
        total += len(item)
        if out_of_vocabulary(vocab_size, prompt=item) is not None:
            raise APIError(
                400,
                f"input: item {i} has token ids past the model's vocabulary (< {vocab_size})",
                param="input",
            )
        if not truncated and len(item) > max_model_len:
            raise APIError(
                400,
                f"input: item {i} has {len(item)} tokens; this model takes at most "
                f"{max_model_len} (truncate_prompt_tokens cuts longer ones)",
                param="input",
            )
    if total > max_model_len * len(inputs):
        raise APIError(
            400,
            f"input: {total} token ids in {len(inputs)} inputs; truncated or not, a request "
            f"carries at most {max_model_len} (the model's context) per input",
            param="input",
        )


def check_dimensions(dimensions: int | None, spec: dict[str, Any]) -> int | None:
    """The `dimensions` to ask the engine for: None for the model's own; a 400 for more than
    it has, or for fewer from a model not trained for them (no Matryoshka model)."""
    size: int = spec["dimensions"]
    if dimensions is None or dimensions == size:
        return None
    if dimensions > size:
        raise APIError(400, f"dimensions: this model's embeddings have {size}", param="dimensions")
    if not spec["matryoshka"]:
        raise APIError(
            400,
            f"dimensions: this model's embeddings have {size} and it was not trained for "
            "fewer (it is no Matryoshka model)",
            param="dimensions",
        )
    return dimensions


def max_pairs(spec: dict[str, Any]) -> int:
    """The most pairs one score or rerank request takes: an embedding model embeds both texts
    of a pair, a cross-encoder runs the pair as one input."""
    return MAX_INPUTS // 2 if spec["task"] == "embed" else MAX_INPUTS


def _listed(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) else text


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")
