"""Bearer-token checks, which paths need them, and where the keys come from."""

from __future__ import annotations

import hashlib

import pytest

from triode.edge import auth
from triode.edge.auth import UNAUTHORIZED_HEADERS, ApiKeys, keys_from, requires_auth


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
    ],
)
def test_v1_paths_need_a_key(method: str, path: str) -> None:
    assert requires_auth(method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("OPTIONS", "/v1/chat/completions"),
        ("OPTIONS", "/v1"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("POST", "/tokenize"),
        ("GET", "/v10/models"),
        ("GET", "/v1models"),
        ("GET", "/"),
    ],
)
def test_other_paths_and_preflight_are_open(method: str, path: str) -> None:
    assert not requires_auth(method, path)


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
