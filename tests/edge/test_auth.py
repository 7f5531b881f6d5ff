"""Bearer-token checks, which paths need them, and where the keys come from."""

from __future__ import annotations

import hashlib

import pytest
import trio
from app_harness import call, make_app

from triode.edge import auth
from triode.edge.auth import (
    UNAUTHORIZED_HEADERS,
    ApiKeys,
    keys_from,
    paths_without_key,
    requires_auth,
)


def test_keys_are_held_only_as_sha256_digests() -> None:
    keys = ApiKeys(["sk-alpha", "sk-beta"])
    held = vars(keys)
    assert "sk-alpha" not in repr(held) and "sk-beta" not in repr(held)
    assert hashlib.sha256(b"sk-alpha").digest() in held["_digests"]


def test_no_keys_means_disabled_and_nothing_matches() -> None:
    keys = ApiKeys(["", ""])
    assert not keys.enabled
    assert not keys.check(b"Bearer ")
    assert not keys.check(b"Bearer anything")


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer sk-beta",
        b"bearer sk-beta",
        b"BEARER sk-beta",
        b"Bearer    sk-beta  ",
        b" Bearer sk-beta",
    ],
)
def test_any_configured_key_with_bearer_scheme_passes(header: bytes) -> None:
    keys = ApiKeys(["sk-alpha", "sk-beta"])
    assert keys.enabled
    assert keys.check(header)


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"Bearer",
        b"Bearer ",
        b"Bearer    ",
        b"Basic sk-alpha",
        b"Token sk-alpha",
        b"Bearersk-alpha",
        b"sk-alpha",
        b"Bearer sk-alph",
        b"Bearer sk-alpha-and-more",
        b"Bearer sk-alpha sk-beta",
        b"Bearer \xff\xfe",
        "Bearer sk-αλφα".encode(),
    ],
)
def test_anything_else_is_refused_without_raising(header: bytes | None) -> None:
    assert not ApiKeys(["sk-alpha", "sk-beta", "sk-αλφα"]).check(header)


def test_every_stored_digest_is_compared_even_after_a_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bytes] = []
    real = auth.secrets.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.secrets, "compare_digest", counting)
    keys = ApiKeys(["first", "second", "third"])
    assert keys.check(b"Bearer first")
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1"),
        ("GET", "/v1/"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("DELETE", "/v1/responses/abc"),
        ("options", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v10/models"),
        ("GET", "/v1models"),
        ("GET", "/"),
        ("GET", "/health/"),
        ("GET", "/Health"),
        ("GET", "//metrics"),
        ("GET", "/metrics/../tokenize"),
    ],
)
def test_every_path_but_the_open_ones_needs_a_key(method: str, path: str) -> None:
    assert requires_auth(method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("OPTIONS", "/v1/chat/completions"),
        ("OPTIONS", "/v1"),
        ("OPTIONS", "/tokenize"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/version"),
    ],
)
def test_operational_paths_and_preflight_are_open(method: str, path: str) -> None:
    assert not requires_auth(method, path)


def test_metrics_require_key_takes_only_metrics_off_the_open_list() -> None:
    guarded = paths_without_key(metrics_require_key=True)
    assert requires_auth("GET", "/metrics", guarded)
    assert not requires_auth("GET", "/health", guarded)
    assert not requires_auth("GET", "/version", guarded)
    assert not requires_auth("GET", "/metrics", paths_without_key())


def test_keys_from_cli_then_env_stripped_and_deduplicated() -> None:
    env = {"TRIODE_API_KEY": " sk-b , ,sk-c,sk-a,, sk-d "}
    assert keys_from(["sk-a", " sk-b", ""], env) == ["sk-a", "sk-b", "sk-c", "sk-d"]


def test_keys_from_keeps_a_cli_key_whole() -> None:
    assert keys_from(["sk,with,commas"], {}) == ["sk,with,commas"]


def test_keys_from_nothing_is_empty() -> None:
    assert keys_from(None, {}) == []
    assert keys_from(None, {"TRIODE_API_KEY": " , "}) == []
    assert keys_from(None, {"TRIODE_API_KEY": "sk-env"}) == ["sk-env"]


def test_unauthorized_headers_ask_for_bearer() -> None:
    assert UNAUTHORIZED_HEADERS == [(b"www-authenticate", b"Bearer")]


# The app's decision, on the real routes (an in-process app over a stub engine)

KEY = "sk-tenant"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [104, 105]}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/responses/resp_x", None),
        ("GET", "/nope", None),
        ("POST", "/v1/../tokenize", {"prompt": "hi"}),
    ],
)
async def test_tokenize_detokenize_and_every_unlisted_path_need_the_key(
    method: str, path: str, body: object
) -> None:
    # vLLM #18892: /tokenize was open, and it runs the chat template and the tokenizer on
    # whatever a stranger sends (up to --max-body-size each time)
    app = make_app(api_keys=ApiKeys([KEY]))

    refused = await call(app, method, path, body)

    assert refused.status == 401, refused.body
    assert refused.headers[b"www-authenticate"] == b"Bearer"
    assert refused.json()["error"]["type"] == "AuthenticationError"
    allowed = await call(app, method, path, body, key=KEY)
    assert allowed.status != 401


async def test_tokenize_answers_with_the_key() -> None:
    app = make_app(api_keys=ApiKeys([KEY]))

    answer = await call(app, "POST", "/tokenize", {"prompt": "hi"}, key=KEY)

    assert answer.status == 200 and answer.json()["tokens"] == [104, 105]


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics"])
async def test_operational_paths_stay_open_by_default(path: str) -> None:
    app = make_app(api_keys=ApiKeys([KEY]))

    assert (await call(app, "GET", path)).status == 200


async def test_metrics_require_key_puts_metrics_behind_the_key() -> None:
    # Who can reach /metrics with the flag: key holders only; without it, anyone who can reach
    # the port (it is a scrape of fixed-size counters: the largest answer is the same few KiB
    # whatever was asked, and it takes no body).
    app = make_app(api_keys=ApiKeys([KEY]), metrics_require_key=True)

    refused = await call(app, "GET", "/metrics")
    assert refused.status == 401 and refused.headers[b"www-authenticate"] == b"Bearer"
    scraped = await call(app, "GET", "/metrics", key=KEY)
    assert scraped.status == 200 and b"triode:num_requests_running" in scraped.body
    assert (await call(app, "GET", "/health")).status == 200


async def test_without_keys_everything_is_open() -> None:
    app = make_app(metrics_require_key=True)

    assert (await call(app, "POST", "/tokenize", {"prompt": "hi"})).status == 200
    assert (await call(app, "GET", "/metrics")).status == 200


async def test_a_stored_response_answers_only_the_key_that_made_it() -> None:
    from triode.edge.responses.response import Response
    from triode.edge.responses.store import StoredResponse

    app = make_app(api_keys=ApiKeys(["sk-alice", "sk-bob"]))
    owner = hashlib.sha256(b"sk-alice").digest()
    entry = StoredResponse(Response(id="resp_a", model="m", status="in_progress"),
                           scope=trio.CancelScope(), owner=owner)  # fmt: skip
    app.responses.store.add(entry)

    for method, path in [("GET", "/v1/responses/resp_a"), ("POST", "/v1/responses/resp_a/cancel"),
                         ("DELETE", "/v1/responses/resp_a")]:  # fmt: skip
        other = await call(app, method, path, key="sk-bob")
        assert other.status == 404, other.body
        assert other.json()["error"]["message"] == "Response with id 'resp_a' not found."
    assert not entry.scope.cancel_called
    assert (await call(app, "GET", "/v1/responses/resp_a", key="sk-alice")).status == 200
    deleted = await call(app, "DELETE", "/v1/responses/resp_a", key="sk-alice")
    assert deleted.status == 200 and entry.scope.cancel_called
