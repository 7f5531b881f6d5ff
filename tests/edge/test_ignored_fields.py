"""Top-level fields the OpenAI endpoints do not know are accepted, ignored and named in the
response (`edge/ignored_fields.py`); the routers' own fields keep their meaning; what asks for
something triode cannot give is a 400; the admin endpoints and nested objects stay strict.

In-process over the stub engine (tests/app_harness.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from app_harness import StubEngine, call

from triode.edge import ignored_fields
from triode.edge.app import App
from triode.edge.completions.request_bodies import CompletionRequest
from triode.edge.settings import Settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "hi"}
HEADER = ignored_fields.HEADER

# What vllm-router 0.1.17 writes into every body it forwards, at its defaults.
ROUTER_COMPLETION = {
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}  # fmt: skip
ROUTER_CHAT = {
    **ROUTER_COMPLETION, "separate_reasoning": True, "stream_reasoning": True,
    "include_reasoning": True, "continue_final_message": False, "logprobs": False,
}  # fmt: skip


def _app(**settings: Any) -> App:
    return App(StubEngine(), Settings(served_model_names=["m"], **settings))  # type: ignore[arg-type]


def _engine(app: App) -> StubEngine:
    engine: StubEngine = app.engine  # type: ignore[assignment]
    return engine


def _body(path: str, **fields: Any) -> dict[str, Any]:
    prompt = {"messages": [USER]} if path == CHAT else {"prompt": "hi"}
    return {"model": "m", "max_tokens": 4, **prompt, **fields}


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ignored_fields, "_logged", set())


@pytest.mark.parametrize(
    ("path", "router"), [(CHAT, ROUTER_CHAT), (COMPLETIONS, ROUTER_COMPLETION)]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_routers_body_is_served_and_its_fields_are_not_called_ignored(
    path: str, router: dict[str, Any], stream: bool
) -> None:
    app = _app()
    answer = await call(app, "POST", path, _body(path, stream=stream, **router))
    assert answer.status == 200, answer.body
    assert HEADER not in answer.headers
    params = _engine(app).sampled[-1]
    assert params is not None and not params.include_stop_str_in_output


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_no_stop_trim_keeps_the_stop_string_as_include_stop_str_in_output_does(
    path: str,
) -> None:
    app = _app()
    assert (await call(app, "POST", path, _body(path, no_stop_trim=True))).status == 200
    params = _engine(app).sampled[-1]
    assert params is not None and params.include_stop_str_in_output


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_asking_for_hidden_states_is_a_400_naming_the_field(path: str) -> None:
    app = _app()
    answer = await call(app, "POST", path, _body(path, return_hidden_states=True))
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["param"] == "return_hidden_states"
    assert "hidden states" in error["message"]
    assert _engine(app).sampled == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
async def test_unknown_fields_are_ignored_named_in_a_header_and_logged_once(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app()
    body = _body(path, gateway_trace="t-1", x_priority_class=3)
    if path == "/tokenize":
        body = {"prompt": "hi", "gateway_trace": "t-1", "x_priority_class": 3}
    with caplog.at_level(logging.INFO, logger=ignored_fields.__name__):
        first = await call(app, "POST", path, body)
        second = await call(app, "POST", path, body)
    assert first.status == second.status == 200, first.body
    assert first.headers[HEADER] == second.headers[HEADER] == b"gateway_trace, x_priority_class"
    logged = [r.getMessage() for r in caplog.records if "ignored request fields" in r.getMessage()]
    assert logged == [f"{path}: ignored request fields gateway_trace, x_priority_class "
                      "(logged once per field name)"]  # fmt: skip


async def test_a_field_name_that_cannot_be_a_header_value_is_left_out_of_it() -> None:
    """A field name is client text: line breaks, non-ASCII and overlong names never reach the
    header (nor the log); the request is still served."""
    app = _app()
    hostile = {"a\r\nset-cookie: x=1": 1, "é": 2, "n" * 65: 3, "ok": 4}
    answer = await call(app, "POST", CHAT, _body(CHAT, **hostile))
    assert answer.status == 200
    assert answer.headers[HEADER] == b"ok"
    assert b"set-cookie" not in answer.headers
    only_hostile = await call(app, "POST", CHAT, _body(CHAT, **{"a\nb": 1}))
    assert only_hostile.status == 200 and HEADER not in only_hostile.headers


async def test_the_header_and_the_log_are_bounded_however_many_names_a_client_invents() -> None:
    app = _app()
    for batch in range(40):
        names = {f"f{batch}_{i}": i for i in range(50)}
        answer = await call(app, "POST", COMPLETIONS, _body(COMPLETIONS, **names))
        assert answer.status == 200
        listed = answer.headers[HEADER].split(b", ")
        assert len(listed) == ignored_fields.MAX_LISTED
    logged = ignored_fields._logged
    assert ignored_fields.MAX_LOGGED <= len(logged) < ignored_fields.MAX_LOGGED + 16


async def test_an_unknown_field_counts_against_the_body_limit() -> None:
    app = _app(max_body_size=4096)
    small = await call(app, "POST", CHAT, _body(CHAT, padding="x" * 1000))
    assert small.status == 200
    large = await call(app, "POST", CHAT, _body(CHAT, padding="x" * 5000))
    assert large.status == 413
    assert _engine(app).sampled.count(None) == 0 and len(_engine(app).sampled) == 1


async def test_nested_objects_stay_strict() -> None:
    app = _app()
    answer = await call(app, "POST", CHAT, _body(CHAT, messages=[{**USER, "colour": "red"}]))
    assert answer.status == 400
    assert answer.json()["error"]["param"] == "messages[0].colour"


async def test_the_admin_endpoints_stay_strict() -> None:
    app = _app(enable_admin_api=True)
    answer = await call(
        app, "POST", "/v1/load_lora_adapter",
        {"lora_name": "a", "lora_path": "/nowhere", "load_in_place": True},
    )  # fmt: skip
    assert answer.status == 400
    assert "load_in_place" in answer.json()["error"]["message"]


async def test_responses_ignore_unknown_fields_too() -> None:
    app = _app()
    with trio.fail_after(10):
        answer = await call(
            app, "POST", "/v1/responses",
            {"model": "m", "input": "hi", "store": False, "gateway_trace": "t"},
        )  # fmt: skip
    assert answer.status == 200, answer.body
    assert answer.headers[HEADER] == b"gateway_trace"


async def test_a_large_body_of_unknown_keys_costs_one_more_decode_and_names_only_the_first() -> (
    None
):
    """Listing every key of a large body of tiny ones would cost several times its decode:
    past `MAX_SCANNED` bytes only the first unknown field is named (the strict decode stops
    there)."""
    app = _app()
    many = {f"k{i}": 0 for i in range(ignored_fields.MAX_SCANNED // 8)}
    body = _body(COMPLETIONS, **many)
    answer = await call(app, "POST", COMPLETIONS, body)
    assert answer.status == 200
    assert answer.headers[HEADER] == b"k0"
    few = await call(app, "POST", COMPLETIONS, _body(COMPLETIONS, a=1, b=2))
    assert few.headers[HEADER] == b"a, b"


def test_a_body_with_only_known_fields_decodes_once_strictly() -> None:
    request, ignored = ignored_fields.decode_body(
        b'{"prompt": "hi", "max_tokens": 2}', CompletionRequest
    )
    assert ignored == [] and isinstance(request, CompletionRequest)
    assert request.max_tokens == 2
