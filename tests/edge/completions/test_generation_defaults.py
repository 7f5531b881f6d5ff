"""The model's request defaults (its generation config, `Engine.generation_defaults`) fill what
a chat, completions or responses request leaves unset, and only that; without any, vLLM's
neutral values stand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from app_harness import StubEngine, call

from triode.actors import RequestOutput
from triode.edge.app import App
from triode.edge.settings import Settings
from triode.wire import SamplingParams

DEFAULTS = {
    "temperature": 0.3,
    "top_p": 0.8,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "max_tokens": 7,
}
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
}
# what max_tokens is where a request leaves it unset, without a default and with one of 7: the
# context window's rest (the stub's prompt: a token a byte) for a chat; OpenAI's 16 for
# completions, whose max_tokens is never unset
UNSET_MAX_TOKENS = {"/v1/chat/completions": (2048 - 2, 7), "/v1/completions": (16, 16)}


@dataclass
class RecordingEngine(StubEngine):
    """The stub engine, keeping each generation's sampling parameters."""

    params: list[SamplingParams] = field(default_factory=list)

    async def generate(  # type: ignore[override]
        self, prompt: list[int] | None, params: SamplingParams | None = None, *args: Any,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        assert params is not None
        self.params.append(params)
        async for output in super().generate(prompt, params, *args, **kwargs):
            yield output


async def _params(defaults: dict[str, Any], path: str, body: dict[str, Any]) -> SamplingParams:
    engine = RecordingEngine(generation_defaults=defaults)
    app = App(engine, Settings(served_model_names=["m"]))  # type: ignore[arg-type]
    answer = await call(app, "POST", path, {"model": "m", **body})
    assert answer.status == 200, answer.body
    [params] = engine.params
    return params


@pytest.mark.parametrize("path", ROUTES)
async def test_a_request_that_leaves_them_unset_gets_the_models_defaults(path: str) -> None:
    params = await _params(DEFAULTS, path, ROUTES[path])
    assert params.temperature == 0.3 and params.top_p == 0.8 and params.top_k == 5
    assert params.min_p == 0.1 and params.repetition_penalty == 1.2
    assert params.max_tokens == UNSET_MAX_TOKENS[path][1]


@pytest.mark.parametrize("path", ROUTES)
async def test_a_request_that_gives_them_keeps_its_own(path: str) -> None:
    given = {"temperature": 0.9, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
             "repetition_penalty": 1.0, "max_tokens": 50}  # fmt: skip
    params = await _params(DEFAULTS, path, {**ROUTES[path], **given})
    assert params.temperature == 0.9 and params.top_p == 1.0 and params.top_k == 0
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0 and params.max_tokens == 50


@pytest.mark.parametrize("path", ROUTES)
async def test_without_defaults_vllms_neutral_values_stand(path: str) -> None:
    params = await _params({}, path, ROUTES[path])
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    assert params.max_tokens == UNSET_MAX_TOKENS[path][0]


async def test_the_model_default_max_tokens_never_outgrows_the_context() -> None:
    chat = "/v1/chat/completions"
    params = await _params({"max_tokens": 10_000}, chat, ROUTES[chat])
    assert params.max_tokens == 2048 - 2


async def test_a_response_takes_the_defaults_it_cannot_give_and_echoes_them() -> None:
    engine = RecordingEngine(generation_defaults=DEFAULTS)
    app = App(engine, Settings(served_model_names=["m"]))  # type: ignore[arg-type]
    answer = await call(app, "POST", "/v1/responses", {"model": "m", "input": "hi"})
    assert answer.status == 200, answer.body
    assert (answer.json()["temperature"], answer.json()["top_p"]) == (0.3, 0.8)
    [params] = engine.params
    assert params.temperature == 0.3 and params.top_k == 5 and params.max_tokens == 7
    answer = await call(
        app, "POST", "/v1/responses", {"model": "m", "input": "hi", "temperature": 1.5}
    )
    assert answer.json()["temperature"] == 1.5 and engine.params[1].temperature == 1.5
