"""A request's `model` picks what it runs (edge/lora_names.py): a served name the base model, a
loaded adapter's name that adapter, anything else a 404; answers and streams name what was
asked for; /v1/models lists each adapter under its base model.

In-process over the stub engine (tests/app_harness.py), whose generations answer with the name
of the adapter they ran with and whose `list_loras` counts its calls."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from app_harness import Answer, StubEngine, call

from triode.edge.app import App, open_app
from triode.edge.lora_names import REFRESH_INTERVAL
from triode.edge.settings import Settings

SERVED = ["base", "base-alias"]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _app(*adapters: str) -> App:
    engine = StubEngine()
    for name in adapters:
        engine.add_lora(name, f"/adapters/{name}")
    return App(engine, Settings(served_model_names=list(SERVED)))  # type: ignore[arg-type]


def _engine(app: App) -> StubEngine:
    engine: StubEngine = app.engine  # type: ignore[assignment]
    return engine


def _body(path: str, model: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


def _text(path: str, answer: Answer) -> str:
    choice = answer.json()["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


def _events(answer: Answer) -> list[dict[str, Any]]:
    lines = answer.body.decode().splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [msgspec.json.decode(d) for d in data[:-1]]


# Picking the model


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("model", "runs", "named"),
    [(None, None, "base"), ("base", None, "base"), ("base-alias", None, "base-alias"),
     ("sql", "sql", "sql")],
)  # fmt: skip
async def test_a_served_name_runs_the_base_and_an_adapters_name_the_adapter(
    path: str, model: str | None, runs: str | None, named: str
) -> None:
    app = _app("sql", "poem")
    answer = await call(app, "POST", path, _body(path, model))
    assert answer.status == 200, answer.body
    assert _engine(app).generated == [runs]
    assert _text(path, answer) == (runs or "base")
    assert answer.json()["model"] == named


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/responses", "/tokenize"])
async def test_an_unknown_model_is_a_404_in_openais_shape_and_runs_nothing(path: str) -> None:
    app = _app("sql")
    bodies = {"/v1/responses": {"model": "nope", "input": "hi"},
              "/tokenize": {"model": "nope", "prompt": "hi"}}  # fmt: skip
    body = bodies.get(path) or _body(path, "nope")
    answer = await call(app, "POST", path, body)
    assert answer.status == 404
    assert answer.json() == {
        "error": {
            "message": "the model 'nope' does not exist",
            "type": "NotFoundError",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert _engine(app).generated == []


async def test_tokenize_and_detokenize_take_an_adapters_name() -> None:
    app = _app("sql")
    tokens = await call(app, "POST", "/tokenize", {"model": "sql", "prompt": "ab"})
    assert tokens.status == 200 and tokens.json()["tokens"] == [97, 98]
    text = await call(app, "POST", "/detokenize", {"model": "sql", "tokens": [97, 98]})
    assert text.status == 200 and text.json() == {"prompt": "ab"}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_every_chunk_of_a_stream_names_the_adapter(path: str) -> None:
    app = _app("sql")
    body = _body(path, "sql", stream=True, stream_options={"include_usage": True})
    answer = await call(app, "POST", path, body)
    assert answer.status == 200, answer.body
    chunks = _events(answer)
    assert len(chunks) >= 2  # the text, then the usage
    assert {chunk["model"] for chunk in chunks} == {"sql"}
    assert _engine(app).generated == ["sql"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_runs_the_adapter_and_names_it(stream: bool) -> None:
    app = _app("sql")
    body = {"model": "sql", "input": "hi", "stream": stream, "store": False}
    answer = await call(app, "POST", "/v1/responses", body)
    assert answer.status == 200, answer.body
    assert _engine(app).generated == ["sql"]
    if not stream:
        response = answer.json()
    else:
        events = [e for e in _events_of_responses(answer) if e["type"] == "response.completed"]
        response = events[0]["response"]
    assert response["model"] == "sql"
    assert response["output"][0]["content"][0]["text"] == "sql"


def _events_of_responses(answer: Answer) -> list[dict[str, Any]]:
    lines = answer.body.decode().splitlines()
    return [msgspec.json.decode(line[6:]) for line in lines if line.startswith("data: ")]


async def test_an_adapter_loaded_elsewhere_is_found_on_the_first_miss() -> None:
    app = _app()
    assert await _call_model(app, "sql") == 404
    _engine(app).add_lora("sql", "/adapters/sql")  # another API server, or the embedding API
    await trio.sleep(REFRESH_INTERVAL)
    assert await _call_model(app, "sql") == 200
    assert _engine(app).generated == ["sql"]


async def test_an_adapter_unloaded_elsewhere_finishes_with_the_engines_error() -> None:
    app = _app("sql")
    assert await _call_model(app, "sql") == 200
    _engine(app).remove_lora("sql")
    answer = await call(app, "POST", COMPLETIONS, _body(COMPLETIONS, "sql"))
    assert answer.status == 200
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "error"
    assert choice["stop_reason"] == "the LoRA adapter 'sql' is not loaded"


async def _call_model(app: App, model: str) -> int:
    return (await call(app, "POST", COMPLETIONS, _body(COMPLETIONS, model))).status


# What a miss costs


async def test_misses_refresh_the_names_at_most_once_a_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = _app("sql")
    engine = _engine(app)
    engine.list_loras_delay = 0.2
    statuses: list[int] = []

    async def unknown(i: int) -> None:
        statuses.append(await _call_model(app, f"nope-{i}"))

    # a flood at once: the misses that come during the one refresh wait for it
    async with trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(unknown, i)
    assert statuses == [404] * 200
    assert engine.list_loras_calls == 1
    # then one every half second for 3 seconds: a refresh a second at most
    for i in range(6):
        await trio.sleep(0.5)
        assert await _call_model(app, f"late-{i}") == 404
    assert 3 <= engine.list_loras_calls <= 4
    assert engine.generated == []
    # a known adapter costs no refresh
    calls = engine.list_loras_calls
    for _ in range(50):
        assert await _call_model(app, "sql") == 200
    assert engine.list_loras_calls == calls


async def test_a_refresh_the_engine_does_not_answer_in_time_ends_in_a_404(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = _app("sql")
    _engine(app).list_loras_delay = 3600.0
    with trio.fail_after(2):
        assert await _call_model(app, "sql") == 404


# /v1/models


async def test_models_lists_each_adapter_under_the_first_served_name() -> None:
    app = _app("sql", "poem")
    answer = await call(app, "GET", "/v1/models")
    assert answer.status == 200
    cards = {card["id"]: card for card in answer.json()["data"]}
    assert list(cards) == ["base", "base-alias", "sql", "poem"]
    for name in SERVED:
        assert cards[name]["root"] == "stub" and cards[name]["parent"] is None
    for name in ("sql", "poem"):
        assert cards[name]["parent"] == "base"
        assert cards[name]["root"] == f"/adapters/{name}"
        assert cards[name]["object"] == "model"
        assert cards[name]["max_model_len"] == 2048


async def test_an_adapter_with_a_base_model_name_has_it_as_its_parent() -> None:
    app = _app("sql")
    _engine(app).loras["sql"]["base_model_name"] = "base-alias"
    cards = (await call(app, "GET", "/v1/models")).json()["data"]
    assert cards[-1]["id"] == "sql" and cards[-1]["parent"] == "base-alias"


async def test_the_app_learns_the_adapters_at_start() -> None:
    engine = StubEngine()
    engine.add_lora("sql", "/adapters/sql")
    settings = Settings(served_model_names=list(SERVED))
    async with open_app(engine, settings) as app:  # type: ignore[arg-type]
        assert engine.list_loras_calls == 1
        assert [a["name"] for a in app.loras.adapters] == ["sql"]
        assert await _call_model(app, "sql") == 200
        assert engine.list_loras_calls == 1


async def test_a_response_the_engine_aborts_is_incomplete_not_a_server_error() -> None:
    """A pause that aborts what runs ends a response as incomplete (reason "abort"), as it
    ends a chat completion with finish_reason "abort": the server did not fail."""
    app = _app("sql")
    _engine(app).finish_reason = "abort"
    answer = await call(app, "POST", "/v1/responses", {"input": "hi", "store": False})
    assert answer.status == 200, answer.body
    response = answer.json()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "abort"}
