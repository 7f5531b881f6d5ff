"""The OpenAI error shape and the 400s built from msgspec and SamplingParams failures."""

from __future__ import annotations

import json

import msgspec
import pytest
from app_harness import StubIntake, call, make_app

from triode.edge.errors import APIError, engine_error, error_body, validation_error
from triode.wire import SamplingParams


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class Request(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    messages: list[Message]
    sampling: SamplingParams | None = None


def _decode_error(body: bytes) -> msgspec.DecodeError:
    with pytest.raises(msgspec.DecodeError) as info:
        msgspec.json.decode(body, type=Request)
    return info.value


@pytest.mark.parametrize(
    ("status", "type_"),
    [
        (400, "BadRequestError"),
        (401, "AuthenticationError"),
        (403, "PermissionDeniedError"),
        (404, "NotFoundError"),
        (405, "MethodNotAllowed"),
        (413, "RequestTooLarge"),
        (422, "UnprocessableEntityError"),
        (429, "RateLimitError"),
        (500, "InternalServerError"),
        (503, "ServiceUnavailableError"),
    ],
)
def test_type_and_code_default_from_status(status: int, type_: str) -> None:
    err = APIError(status, "nope")
    assert (err.status, err.message, err.type, err.param, err.code) == (
        status,
        "nope",
        type_,
        None,
        status,
    )
    assert str(err) == "nope"


def test_explicit_type_param_and_code_are_kept() -> None:
    err = APIError(400, "too long", type="invalid_request_error", param="messages", code="ctx")
    assert (err.type, err.param, err.code) == ("invalid_request_error", "messages", "ctx")


def test_unlisted_status_falls_back_by_class() -> None:
    assert APIError(409, "x").type == "BadRequestError"
    assert APIError(502, "x").type == "InternalServerError"


def test_error_body_has_all_four_fields_with_nulls() -> None:
    body = json.loads(error_body(APIError(404, "no such model")))
    assert body == {
        "error": {"message": "no such model", "type": "NotFoundError", "param": None, "code": 404}
    }


def test_error_body_is_compact_json() -> None:
    raw = error_body(APIError(400, "bad", param="n", code="invalid_value"))
    assert b"\n" not in raw
    assert json.loads(raw)["error"] == {
        "message": "bad",
        "type": "BadRequestError",
        "param": "n",
        "code": "invalid_value",
    }


def test_wrong_type_deep_in_a_list_names_the_path() -> None:
    exc = _decode_error(b'{"model": "m", "messages": [{"role": "user", "content": 3}]}')
    err = validation_error(exc)
    assert err.status == 400
    assert err.param == "messages[0].content"
    assert err.message == "messages[0].content: Expected `str`, got `int`"


def test_missing_required_field_at_top_level_is_the_param() -> None:
    err = validation_error(_decode_error(b'{"model": "m"}'))
    assert err.param == "messages"
    assert err.message == "messages: missing required field"


def test_missing_required_field_inside_an_item_joins_the_path() -> None:
    err = validation_error(_decode_error(b'{"model": "m", "messages": [{"role": "user"}]}'))
    assert err.param == "messages[0].content"
    assert "messages[0].content" in err.message


def test_unknown_field_is_the_param() -> None:
    err = validation_error(_decode_error(b'{"model": "m", "messages": [], "temprature": 1}'))
    assert err.param == "temprature"
    assert err.message == "temprature: unknown field"


def test_sampling_params_value_error_names_its_field() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(temperature=-1.0)
    err = validation_error(info.value)
    assert err.param == "temperature"
    assert err.message == "temperature: must be in [0, 2**100]"


def test_post_init_error_under_a_path_joins_both() -> None:
    body = b'{"model": "m", "messages": [], "sampling": [1, 1.0, 0.0]}'
    err = validation_error(_decode_error(body))
    assert err.param == "sampling.top_p"
    assert err.message == "sampling.top_p: must be in (0, 1]"


def test_root_type_mismatch_has_no_param() -> None:
    err = validation_error(_decode_error(b"[1, 2]"))
    assert err.param is None
    assert err.message == "Expected `object`, got `array`"


@pytest.mark.parametrize("body", [b"{not json", b'{"model": "m", "messages": []} x', b""])
def test_malformed_json_is_invalid_json_without_param(body: bytes) -> None:
    err = validation_error(_decode_error(body))
    assert err.status == 400
    assert err.param is None
    assert err.message.startswith("invalid JSON: ")
    assert len(err.message) > len("invalid JSON: ")


def test_plain_value_error_without_a_field_is_kept_verbatim() -> None:
    err = validation_error(ValueError("prompt is longer than the context window"))
    assert (err.param, err.message) == (None, "prompt is longer than the context window")


def test_a_full_engine_queue_is_a_429_with_retry_after() -> None:
    from triode.actors import RequestRefused

    error = engine_error(RequestRefused("the server is busy", retry_after=2.5))

    assert (error.status, error.type, error.code) == (429, "RateLimitError", 429)
    assert error.headers == [(b"retry-after", b"3")]  # whole seconds, rounded up
    assert engine_error(RequestRefused("busy", retry_after=0)).headers == [(b"retry-after", b"1")]


# Nothing internal reaches a client

SECRET = (
    "actor 'engine-core' failed with RuntimeError: boom\n--- remote traceback ---\n"
    'Traceback (most recent call last):\n  File "/srv/triode/actors/engine_core.py", line 9\n'
)


def _leaks(text: str) -> bool:
    return any(s in text for s in ("Traceback", 'File "', "/srv/", ".py", "boom"))


def test_engine_errors_say_what_happened_not_why() -> None:
    from triode.actors import EngineDeadError

    for error in (EngineDeadError(f"the engine core died: {SECRET}"), RuntimeError(SECRET)):
        answer = engine_error(error)
        assert answer.status in (500, 503) and not _leaks(error_body(answer).decode())


class _FailingIntake(StubIntake):
    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError(SECRET)


async def test_an_internal_error_is_a_bare_500_whatever_it_was() -> None:
    app = make_app()
    app.engine.intake = _FailingIntake()

    answer = await call(app, "POST", "/tokenize", {"prompt": "hi"})

    assert answer.status == 500
    assert answer.json() == {"error": {"message": "internal server error",
                                       "type": "InternalServerError", "param": None,
                                       "code": 500}}  # fmt: skip


@pytest.mark.parametrize(("method", "path"), [("GET", "/health"), ("POST", "/v1/completions")])
async def test_a_dead_engine_is_a_503_without_its_traceback(method: str, path: str) -> None:
    from triode.actors import EngineDeadError

    app = make_app()
    app.engine.dead = EngineDeadError(f"the engine core died: {SECRET}")

    answer = await call(app, method, path, {"prompt": "hi", "max_tokens": 1})

    assert answer.status == 503 and not _leaks(answer.body.decode())
