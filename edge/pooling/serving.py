"""The pooling endpoints over one engine: `/v1/embeddings`, `/pooling`, `/score` (and
`/v1/score`), `/rerank` (and `/v1/rerank`, `/v2/rerank`).

A request is decoded and checked against the model's pooling (its task, dimensions, context
length and vocabulary), then runs as one call of the engine's pooling API (`embed`, `classify`
or `score`) beside a task that watches for `http.disconnect`: a disconnect cancels the call,
and cancelling it aborts every input's request in the engine. A model that generates text
serves none of these (a 400).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import trio

from triode.actors import Engine, EngineDeadError, RequestError

from ..completions.generation import data_parallel_rank
from ..errors import APIError, check_engine_alive, engine_error
from ..http import ClientDisconnected, Request, respond_json
from ..lora_names import LoraNames
from ..metrics import Metrics
from ..settings import Settings
from .request_bodies import (
    EmbeddingRequest,
    PoolingBody,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    check_dimensions,
    check_token_inputs,
    check_truncation,
    decode_pooling_request,
    max_pairs,
)
from .response_bodies import (
    Pooled,
    embedding_response,
    pooling_response,
    rerank_response,
    score_response,
)

if TYPE_CHECKING:
    from ..app import App

# OpenAI's type for a request the model cannot serve (the edge's other 400s use vLLM's names)
NOT_SERVED_TYPE: Final = "invalid_request_error"

PoolingCall = Callable[..., Awaitable[Sequence[Pooled]]]
_BodyT = TypeVar("_BodyT", bound=PoolingBody)


class Pooling:
    """The pooling handlers over one engine."""

    def __init__(
        self, engine: Engine, settings: Settings, metrics: Metrics, loras: LoraNames
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.loras = loras
        self.model_name = settings.served_model_names[0]

    async def embeddings(self, request: Request) -> None:
        req = await self._read(request, EmbeddingRequest)
        spec = await self._spec(req.model, "embeddings", tasks=("embed",))
        inputs = self._inputs(req)
        call = self._embed_call(req, spec, inputs)
        await self._answer_vectors(request, req, call, "embd", embedding_response)

    async def pooling(self, request: Request) -> None:
        """An embedding model's embeddings, a classifier's probabilities per label."""
        req = await self._read(request, PoolingRequest)
        spec = await self._spec(req.model, "pooling")
        task = spec["task"]
        if req.task is not None and req.task != task:
            raise APIError(400, f"task: this model serves {task!r}, not {req.task!r}", param="task")
        inputs = self._inputs(req)
        call: PoolingCall
        if task == "embed":
            call = self._embed_call(req, spec, inputs)
        else:
            for name in ("dimensions", "normalize"):
                if getattr(req, name) is not None:
                    raise APIError(
                        400,
                        f"{name}: this model classifies; its outputs are probabilities",
                        param=name,
                    )
            _check_activation(req.use_activation)
            call = functools.partial(
                self.engine.classify, inputs, truncate_prompt_tokens=req.truncate_prompt_tokens
            )
        await self._answer_vectors(request, req, call, "pool", pooling_response)

    async def _answer_vectors(
        self,
        request: Request,
        req: EmbeddingRequest,
        call: PoolingCall,
        prefix: str,
        shape: Callable[..., Any],
    ) -> None:
        """Run `call` and answer its vectors in the body `shape` builds (embeddings, pooling),
        encoded as the request asks."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        outputs = await self._run(request, call, request_id)
        response = shape(
            outputs,
            request_id=request_id,
            model=req.model or self.model_name,
            encoding_format=req.encoding_format,
            endianness=req.endianness,
        )
        await respond_json(request.send, response)

    def _embed_call(
        self, req: EmbeddingRequest | PoolingRequest, spec: dict[str, Any], inputs: Any
    ) -> PoolingCall:
        """`engine.embed` of `inputs` as the request asks (dimensions, normalisation, cut)."""
        return functools.partial(
            self.engine.embed,
            inputs,
            dimensions=check_dimensions(req.dimensions, spec),
            normalize=req.wants_normalized(),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )

    async def score(self, request: Request) -> None:
        req = await self._read(request, ScoreRequest)
        spec = await self._spec(req.model, "scores")
        first, second = req.pairs()
        self._check_pairs(req, spec, len(second), "text_2")
        call = functools.partial(
            self.engine.score, first, second, truncate_prompt_tokens=req.truncate_prompt_tokens
        )
        request_id = f"score-{uuid.uuid4().hex}"
        outputs = await self._run(request, call, request_id)
        model = req.model or self.model_name
        await respond_json(
            request.send, score_response(outputs, request_id=request_id, model=model)
        )

    async def rerank(self, request: Request) -> None:
        req = await self._read(request, RerankRequest)
        spec = await self._spec(req.model, "reranking")
        documents = req.documents
        self._check_pairs(req, spec, len(documents), "documents")
        call = functools.partial(
            self.engine.score,
            [req.query] * len(documents),
            documents,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        request_id = f"rerank-{uuid.uuid4().hex}"
        outputs = await self._run(request, call, request_id)
        response = rerank_response(
            outputs,
            documents,
            top_n=req.top_n,
            return_documents=req.return_documents,
            request_id=request_id,
            model=req.model or self.model_name,
        )
        await respond_json(request.send, response)

    async def _read(self, request: Request, kind: type[_BodyT]) -> _BodyT:
        body = await request.read_body(self.settings.max_body_size)
        return decode_pooling_request(body, kind, request)

    async def _spec(
        self, model: str | None, what: str, *, tasks: tuple[str, ...] = ("embed", "classify")
    ) -> dict[str, Any]:
        """The model's pooling (`Engine.pooling`) once the request's `model` names it and the
        engine runs; a 400 when the model serves none of `tasks`."""
        if await self.loras.pick(model) is not None:
            raise APIError(400, f"model: LoRA adapters do not serve {what}", param="model")
        check_engine_alive(self.engine)
        spec: dict[str, Any] | None = self.engine.pooling
        if spec is None:
            does = "it generates text (use /v1/completions or /v1/chat/completions)"
        elif spec["task"] not in tasks:
            does = "it classifies (use /pooling, /score or /rerank)"
        else:
            return spec
        raise APIError(400, f"this model does not serve {what}: {does}", type=NOT_SERVED_TYPE)

    def _inputs(self, req: EmbeddingRequest) -> list[str | list[int]]:
        """The request's inputs, once those given as token ids are known to fit the model."""
        max_model_len = self.engine.max_model_len
        check_truncation(req.truncate_prompt_tokens, max_model_len)
        inputs = req.inputs()
        check_token_inputs(
            inputs,
            max_model_len=max_model_len,
            vocab_size=self.engine.vocab_size,
            truncated=req.truncate_prompt_tokens is not None,
        )
        return inputs

    def _check_pairs(
        self, req: ScoreRequest | RerankRequest, spec: dict[str, Any], pairs: int, param: str
    ) -> None:
        check_truncation(req.truncate_prompt_tokens, self.engine.max_model_len)
        _check_activation(req.use_activation)
        limit = max_pairs(spec)
        if pairs > limit:
            raise APIError(
                400,
                f"{param}: {pairs} pairs; this model scores at most {limit} in one request",
                param=param,
            )

    async def _run(self, request: Request, call: PoolingCall, request_id: str) -> Sequence[Pooled]:
        """`call`'s outputs, the call cancelled if the client goes away first (then
        `ClientDisconnected`); the engine's refusals as `engine_error` answers them. Each
        output counts as one finished request in the metrics."""
        rank = data_parallel_rank(request)
        start = time.perf_counter()
        outputs: Sequence[Pooled] = ()
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request.cancel_on_disconnect, nursery.cancel_scope)
            try:
                outputs = await call(request_id=request_id, data_parallel_rank=rank)
            except (RequestError, EngineDeadError, RuntimeError) as e:
                failure = e
            nursery.cancel_scope.cancel()
        if request.disconnected:
            raise ClientDisconnected
        if failure is not None:
            raise engine_error(failure)
        e2e = time.perf_counter() - start
        for out in outputs:
            self.metrics.observe_request(
                prompt_tokens=out.num_prompt_tokens,
                generation_tokens=0,
                ttft=None,
                inter_token_latencies=(),
                e2e=e2e,
                finished_reason="stop",
            )
        return outputs


def _check_activation(use_activation: bool | None) -> None:
    if use_activation is False:
        raise APIError(
            400,
            "use_activation: scores before the model's activation are not served",
            param="use_activation",
        )


async def embeddings(app: App, request: Request) -> None:
    await app.pooling.embeddings(request)


async def pooling(app: App, request: Request) -> None:
    await app.pooling.pooling(request)


async def score(app: App, request: Request) -> None:
    await app.pooling.score(request)


async def rerank(app: App, request: Request) -> None:
    await app.pooling.rerank(request)


POOLING_ROUTES: Final[dict[str, dict[str, Callable[[App, Request], Awaitable[None]]]]] = {
    "/v1/embeddings": {"POST": embeddings},
    "/pooling": {"POST": pooling},
    "/score": {"POST": score},
    "/v1/score": {"POST": score},
    "/rerank": {"POST": rerank},
    "/v1/rerank": {"POST": rerank},
    "/v2/rerank": {"POST": rerank},
}
