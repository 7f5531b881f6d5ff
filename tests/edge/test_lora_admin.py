"""Loading and unloading LoRA adapters over HTTP (edge/admin.py, vLLM's routes): served only
with `--enable-admin-api`, behind the key, bodies checked before the engine hears of them, the
engine's refusals answered 400, 404 or 409, and the names a request may give refreshed before
the answer goes out.

In-process over the stub engine (tests/app_harness.py), whose adapter registry refuses as the
engine core's does."""

from __future__ import annotations

from typing import Any

import pytest
from app_harness import Answer, StubEngine, call

from triode.actors import OperationError
from triode.edge.app import App
from triode.edge.auth import ApiKeys
from triode.edge.settings import Settings

KEY = "admin-key"
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
SQL = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def _app(*, enabled: bool = True, keys: tuple[str, ...] = (KEY,), **settings: Any) -> App:
    config = Settings(
        served_model_names=["base", "alias"], api_keys=ApiKeys(keys), enable_admin_api=enabled,
        **settings,
    )  # fmt: skip
    return App(StubEngine(), config)  # type: ignore[arg-type]


def _engine(app: App) -> StubEngine:
    engine: StubEngine = app.engine  # type: ignore[assignment]
    return engine


async def _post(app: App, path: str, body: Any, key: str | None = KEY) -> Answer:
    return await call(app, "POST", path, body, key=key)


async def _complete(app: App, model: str) -> Answer:
    return await _post(app, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})


def _error(answer: Answer) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["error"]
    return error


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
async def test_without_the_flag_the_routes_are_404s(path: str) -> None:
    app = _app(enabled=False)
    answer = await _post(app, path, SQL if path == LOAD else {"lora_name": "sql"})
    assert answer.status == 404 and _error(answer)["message"] == f"no route for {path}"
    assert _engine(app).loras == {}


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
async def test_with_keys_the_routes_need_one(path: str) -> None:
    app = _app()
    _engine(app).add_lora("sql", "/adapters/sql")
    body = SQL if path == LOAD else {"lora_name": "sql"}
    for key in (None, "wrong-key"):
        assert (await _post(app, path, body, key=key)).status == 401
    assert list(_engine(app).loras) == ["sql"] and _engine(app).list_loras_calls == 0


async def test_a_load_answers_with_the_engines_entry_and_the_adapter_serves_at_once() -> None:
    app = _app()
    answer = await _post(app, LOAD, SQL)
    assert answer.status == 200, answer.body
    entry = answer.json()
    assert entry == _engine(app).loras["sql"]
    assert {"name", "path", "lora_id", "digest", "rank", "base_model_name"} <= set(entry)
    calls = _engine(app).list_loras_calls
    assert calls == 1  # refreshed before the answer went out
    completion = await _complete(app, "sql")
    assert completion.status == 200 and completion.json()["model"] == "sql"
    assert completion.json()["choices"][0]["text"] == "sql"
    models = (await call(app, "GET", "/v1/models", key=KEY)).json()["data"]
    assert [card["id"] for card in models] == ["base", "alias", "sql"]
    assert _engine(app).list_loras_calls == calls


async def test_an_unload_forgets_the_name_and_a_second_unload_is_a_404() -> None:
    app = _app()
    assert (await _post(app, LOAD, SQL)).status == 200
    answer = await _post(app, UNLOAD, {"lora_name": "sql", "lora_int_id": 7})
    assert answer.status == 200, answer.body
    assert answer.json()["name"] == "sql"
    assert (await _complete(app, "sql")).status == 404
    again = await _post(app, UNLOAD, {"lora_name": "sql"})
    assert again.status == 404
    assert _error(again) == {
        "message": "The lora adapter 'sql' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": "not_found",
    }


async def test_loading_a_loaded_name_is_a_400_unless_in_place() -> None:
    app = _app()
    assert (await _post(app, LOAD, SQL)).status == 200
    first = _engine(app).loras["sql"]["lora_id"]
    v2 = {**SQL, "lora_path": "/adapters/sql-v2"}
    again = await _post(app, LOAD, v2)
    assert again.status == 400
    assert _error(again)["message"] == "The lora adapter 'sql' has already been loaded."
    in_place = await _post(app, LOAD, {**v2, "load_inplace": True})
    assert in_place.status == 200, in_place.body
    assert in_place.json()["path"] == "/adapters/sql-v2" and in_place.json()["lora_id"] != first
    models = (await call(app, "GET", "/v1/models", key=KEY)).json()["data"]
    assert models[-1]["root"] == "/adapters/sql-v2"


async def test_a_path_the_engine_does_not_allow_is_a_400_with_its_message() -> None:
    app = _app()
    answer = await _post(app, LOAD, {"lora_name": "x", "lora_path": "/etc"})
    assert answer.status == 400
    assert _error(answer)["message"] == "'/etc' is not under --allowed-lora-paths"
    assert _error(answer)["code"] == "invalid"


@pytest.mark.parametrize(
    ("kind", "status"), [("conflict", 409), ("unsupported", 400), ("not_found", 404)]
)
async def test_an_engine_refusal_of_a_load_keeps_its_status(
    kind: str, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app()

    def refuse(*args: Any) -> dict[str, Any]:
        raise OperationError(kind, f"refused: {kind}")

    monkeypatch.setattr(_engine(app), "add_lora", refuse)
    answer = await _post(app, LOAD, SQL)
    assert answer.status == status
    assert _error(answer)["message"] == f"refused: {kind}" and _error(answer)["code"] == kind


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
@pytest.mark.parametrize("name", ["base", "alias"])
async def test_an_adapter_named_like_a_served_model_is_a_400(path: str, name: str) -> None:
    app = _app()
    body = {"lora_name": name, "lora_path": "/adapters/x"} if path == LOAD else {"lora_name": name}
    answer = await _post(app, path, body)
    assert answer.status == 400
    assert _error(answer)["param"] == "lora_name"
    assert "served model name" in _error(answer)["message"]
    assert _engine(app).loras == {} and _engine(app).list_loras_calls == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (LOAD, {"lora_name": "sql"}, "lora_path"),
        (LOAD, {"lora_path": "/adapters/sql"}, "lora_name"),
        (LOAD, {**SQL, "lora_int_id": 3}, "lora_int_id"),
        (LOAD, {**SQL, "extra": 1}, "extra"),
        (LOAD, {**SQL, "load_inplace": "yes"}, "load_inplace"),
        (LOAD, {**SQL, "lora_name": ""}, "lora_name"),
        (LOAD, {**SQL, "lora_name": "n" * 257}, "lora_name"),
        (LOAD, {**SQL, "lora_name": "two words"}, "lora_name"),
        (UNLOAD, {"lora_name": "tab\there"}, "lora_name"),
        (LOAD, {**SQL, "lora_path": ""}, "lora_path"),
        (LOAD, {**SQL, "lora_path": "/adapters/\x00sql"}, "lora_path"),
        (LOAD, {**SQL, "lora_path": "/" * 4097}, "lora_path"),
        (UNLOAD, {}, "lora_name"),
        (UNLOAD, {"lora_name": "sql", "lora_path": "/adapters/sql"}, "lora_path"),
        (UNLOAD, {"lora_name": 3}, "lora_name"),
    ],
)  # fmt: skip
async def test_a_bad_body_is_a_400_naming_its_field(
    path: str, body: dict[str, Any], param: str
) -> None:
    app = _app()
    _engine(app).add_lora("sql", "/adapters/sql")
    answer = await _post(app, path, body)
    assert answer.status == 400, answer.body
    assert _error(answer)["param"] == param
    assert list(_engine(app).loras) == ["sql"] and _engine(app).list_loras_calls == 0


@pytest.mark.parametrize("path", [LOAD, UNLOAD])
async def test_a_body_that_is_not_json_or_too_big_is_refused(path: str) -> None:
    app = _app(max_body_size=1024)
    assert (await _post(app, path, b"{not json")).status == 400
    assert (await _post(app, path, b"[]")).status == 400
    assert (await _post(app, path, {"lora_name": "x" * 2048})).status == 413
    assert _engine(app).list_loras_calls == 0
