"""The pooling API of an `Engine`: embeddings, classification and scores for trio apps.

```python
async with open_engine(model="all-MiniLM-L6-v2/") as engine:
    [a, b] = await engine.embed(["a cat sat", "a dog ran"])
    print(float(a.data @ b.data))
```

Every input is one prefill-only request in the engine core's scheduler (batched with whatever
else runs); its pooled output comes back in place of tokens and nothing is kept for it after.
What the model pools and how (`pooling` of its ready info) comes from the model: the
sentence-transformers files of an encoder, last-token pooling for a decoder served with
`runner="pooling"`. Normalisation, Matryoshka truncation and a classifier's activation are
applied here, in float32.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from triode.wire import EngineCoreRequest, FinishReason, PoolingParams, SamplingParams

from .core_client import EngineCoreClient, RequestStream
from .errors import RequestError, RequestRefused

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# The most inputs one call takes (OpenAI's cap for one embeddings request): each is a request
# in the engine core's queue, and their outputs are held until the last one is done.
MAX_POOLING_INPUTS = 2048

PoolingInput = str | list[int]


@dataclass(slots=True)
class PooledOutput:
    """One input's result: `data` (float32, 1-D) and the prompt tokens it took."""

    data: np.ndarray
    num_prompt_tokens: int


class PoolingAPI:
    """`embed`, `classify` and `score`, for an `Engine` whose model pools (`pooling` set)."""

    pooling: dict[str, Any] | None
    max_model_len: int
    tokenizer: Tokenizer
    eos_token_id: int | None

    def _pick(self, rank: int | None = None) -> EngineCoreClient: ...

    async def embed(
        self,
        inputs: Sequence[PoolingInput],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> list[PooledOutput]:
        """Each input's embedding, in order: a string (tokenized with the model's special
        tokens) or token ids. `dimensions` keeps the first that many (Matryoshka models only),
        before normalising; `normalize` None does as the model does.
        `truncate_prompt_tokens` keeps the first k tokens of a longer input (-1: the model's
        context length) with its special tokens; without it, a longer one is refused.

        A checkpoint. Cancelling it aborts every input's request. Raises `RequestError` for
        what the model cannot take, `RequestRefused` when the engine core's queue is full, and
        `EngineDeadError` if the engine dies."""
        spec = self._pooling_spec("embed")
        size = spec["dimensions"]
        if dimensions is not None:
            if not spec["matryoshka"] and dimensions != size:
                raise RequestError(
                    f"dimensions: this model returns {size} dimensions and was not trained "
                    "for fewer (it is no Matryoshka model)"
                )
            if not 1 <= dimensions <= size:
                raise RequestError(f"dimensions must be 1 to {size}, not {dimensions}")
        prompts = [self._pooling_prompt(x, truncate_prompt_tokens) for x in inputs]
        outputs = await self._pool(prompts, PoolingParams("embed"), request_id, data_parallel_rank)
        normalize = spec["normalize"] if normalize is None else normalize
        for out in outputs:
            data = out.data[:dimensions] if dimensions is not None else out.data
            out.data = _normalized(data) if normalize else np.array(data, np.float32)
        return outputs

    async def classify(
        self,
        inputs: Sequence[PoolingInput],
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> list[PooledOutput]:
        """Each input's class probabilities (the model's activation over its logits), in the
        order of its labels. As `embed` otherwise."""
        spec = self._pooling_spec("classify")
        prompts = [self._pooling_prompt(x, truncate_prompt_tokens) for x in inputs]
        outputs = await self._pool(
            prompts, PoolingParams("classify"), request_id, data_parallel_rank
        )
        for out in outputs:
            out.data = _activated(out.data, spec["activation"])
        return outputs

    async def score(
        self,
        text_1: Sequence[PoolingInput],
        text_2: Sequence[PoolingInput],
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> list[PooledOutput]:
        """How well `text_1[i]` goes with `text_2[i]`, for each i: a cross-encoder's score of
        the pair (one label, after its activation), or the cosine similarity of an embedding
        model's two embeddings. Each output's `data` is one float; its token count is both
        texts'. As `embed` otherwise."""
        if len(text_1) != len(text_2):
            raise RequestError(
                f"score: {len(text_1)} first texts for {len(text_2)} second ones; give as many"
            )
        task = (self.pooling or {}).get("task")
        if task == "embed":
            both = await self.embed(
                [*text_1, *text_2],
                normalize=True,
                truncate_prompt_tokens=truncate_prompt_tokens,
                request_id=request_id,
                data_parallel_rank=data_parallel_rank,
            )
            firsts, seconds = both[: len(text_1)], both[len(text_1) :]
            return [
                PooledOutput(
                    np.array([float(a.data @ b.data)], np.float32),
                    a.num_prompt_tokens + b.num_prompt_tokens,
                )
                for a, b in zip(firsts, seconds, strict=True)
            ]
        spec = self._pooling_spec("classify")
        if len(spec["labels"]) > 1:
            raise RequestError(
                f"score: this classifier has {len(spec['labels'])} labels; a score needs one"
            )
        pairs = [
            self._pair_prompt(a, b, truncate_prompt_tokens)
            for a, b in zip(text_1, text_2, strict=True)
        ]
        outputs = await self._pool(pairs, None, request_id, data_parallel_rank)
        for out in outputs:
            out.data = _activated(out.data, spec["activation"])
        return outputs

    def _pooling_spec(self, task: str) -> dict[str, Any]:
        spec = self.pooling
        if spec is None:
            raise RequestError(
                "this model generates text and does not serve embeddings or scores; serve an "
                "embedding model, or this one with runner 'pooling'"
            )
        if spec["task"] != task:
            does = "embeddings" if spec["task"] == "embed" else "classification and scores"
            raise RequestError(f"this model serves {does}, not {task}")
        return spec

    def _pooling_prompt(
        self, prompt: PoolingInput, truncate: int | None
    ) -> tuple[list[int], PoolingParams | None]:
        if isinstance(prompt, str):
            encoding = self.tokenizer.encode(prompt, add_special_tokens=False)
            return self._fitted(self._finished(encoding, None, truncate).ids, None), None
        return self._fitted(list(prompt), truncate), None

    def _pair_prompt(
        self, first: PoolingInput, second: PoolingInput, truncate: int | None
    ) -> tuple[list[int], PoolingParams | None]:
        """A cross-encoder's pair: both texts in the model's pair template, the second's
        segment marked; token ids are taken as they come, the second starting its segment."""
        if isinstance(first, str) and isinstance(second, str):
            a = self.tokenizer.encode(first, add_special_tokens=False)
            b = self.tokenizer.encode(second, add_special_tokens=False)
            encoding = self._finished(a, b, truncate)
            # the second segment starts where the template's segment ids turn to 1
            boundary = encoding.type_ids.index(1) if 1 in encoding.type_ids else 0
            return self._fitted(encoding.ids, None), PoolingParams("classify", boundary)
        if isinstance(first, str) or isinstance(second, str):
            raise RequestError("score: give both texts of a pair as strings, or both as tokens")
        ids = self._fitted([*first, *second], truncate)
        return ids, PoolingParams("classify", pair_boundary=min(len(first), len(ids)))

    def _finished(self, encoding: Any, pair: Any, truncate: int | None) -> Any:
        """The encoding (and its pair's) with the model's special tokens, cut to `truncate`
        tokens in all as the tokenizer cuts (the longer text first), special tokens kept."""
        limit = self._limit(truncate)
        if limit is not None:
            room = limit - self.tokenizer.num_special_tokens_to_add(pair is not None)
            if room < 1:
                raise RequestError(f"truncate_prompt_tokens of {limit} leaves no room for text")
            if pair is None:
                encoding.truncate(room)
            else:
                encoding, pair = _truncate_pair(encoding, pair, room)
        return self.tokenizer.post_process(encoding, pair, add_special_tokens=True)

    def _fitted(self, ids: list[int], truncate: int | None) -> list[int]:
        limit = self._limit(truncate)
        if limit is not None:
            ids = ids[:limit]
        if not ids:
            raise RequestError("an input is empty")
        if len(ids) > self.max_model_len:
            raise RequestError(
                f"an input has {len(ids)} tokens; this model takes at most {self.max_model_len}"
                " (truncate_prompt_tokens cuts longer ones)"
            )
        return ids

    def _limit(self, truncate: int | None) -> int | None:
        if truncate is None:
            return None
        if truncate == -1:
            return self.max_model_len
        if not 1 <= truncate <= self.max_model_len:
            raise RequestError(
                f"truncate_prompt_tokens must be -1 or 1 to {self.max_model_len}, not {truncate}"
            )
        return truncate

    async def _pool(
        self,
        prompts: list[tuple[list[int], PoolingParams | None]],
        params: PoolingParams | None,
        request_id: str | None,
        data_parallel_rank: int | None,
    ) -> list[PooledOutput]:
        """Each prompt as one pooling request to one engine core; their outputs in order."""
        if not prompts:
            raise RequestError("give at least one input")
        if len(prompts) > MAX_POOLING_INPUTS:
            raise RequestError(
                f"{len(prompts)} inputs in one request; at most {MAX_POOLING_INPUTS}"
            )
        client = self._pick(data_parallel_rank)
        base = request_id or uuid.uuid4().hex
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[PooledOutput | None] = [None] * len(prompts)
        stream = RequestStream()
        sent: list[str] = []
        now = time.time()
        try:
            for rid, (prompt, own) in zip(ids, prompts, strict=True):
                request = EngineCoreRequest(
                    rid, prompt, _NO_SAMPLING, self.eos_token_id, arrival_time=now,
                    pooling_params=own or params,
                )  # fmt: skip
                await client.add_request(request, stream)
                sent.append(rid)
            pending = len(prompts)
            while pending:
                for out in await stream.get():
                    i = index.get(out.request_id)
                    if i is None or results[i] is not None:
                        continue
                    if out.finish_reason is FinishReason.REFUSED:
                        raise RequestRefused(str(out.stop_reason or "the engine is busy"))
                    if out.pooled is None or out.finish_reason is not FinishReason.STOP:
                        raise RequestError(str(out.stop_reason or "the engine failed the input"))
                    results[i] = PooledOutput(
                        np.array(out.pooled, np.float32).reshape(-1), len(prompts[i][0])
                    )
                    pending -= 1
        finally:
            unfinished = [rid for rid in sent if results[index[rid]] is None]
            with trio.CancelScope(shield=True):
                await client.abort_requests(unfinished)
        return [r for r in results if r is not None]


# what a pooling request carries in place of sampling parameters: it samples nothing
_NO_SAMPLING = SamplingParams(max_tokens=1)


def _normalized(data: np.ndarray) -> np.ndarray:
    """L2-normalised as sentence-transformers' Normalize (torch's `normalize`, eps 1e-12)."""
    data = np.asarray(data, np.float32)
    return data / max(float(np.linalg.norm(data)), 1e-12)


def _activated(logits: np.ndarray, activation: str) -> np.ndarray:
    logits = np.asarray(logits, np.float32)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    if activation == "softmax":
        shifted = np.exp(logits - logits.max())
        return (shifted / shifted.sum()).astype(np.float32)
    return logits.copy()


def _truncate_pair(a: Any, b: Any, room: int) -> tuple[Any, Any]:
    """Two encodings cut to `room` tokens in all, a token at a time from the longer one
    (transformers' "longest_first")."""
    keep_a, keep_b = len(a.ids), len(b.ids)
    while keep_a + keep_b > room:
        if keep_a > keep_b:
            keep_a -= 1
        else:
            keep_b -= 1
    a.truncate(keep_a)
    b.truncate(keep_b)
    return a, b
