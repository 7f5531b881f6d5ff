"""The salt a request's prompt blocks are hashed with, from its cache_salt and its caller's key."""

from __future__ import annotations

import hashlib

from triode.edge.auth import ApiKeys
from triode.edge.completions.request_bodies import MAX_CACHE_SALT
from triode.edge.tenancy import request_cache_salt
from triode.wire.messages import MAX_WIRE_CACHE_SALT

ALICE = hashlib.sha256(b"sk-alice").digest()
BOB = hashlib.sha256(b"sk-bob").digest()


def test_without_isolation_the_salt_is_the_callers_own() -> None:
    assert request_cache_salt("none", ALICE, None) is None
    assert request_cache_salt("none", ALICE, "s") == request_cache_salt("none", BOB, "s") == "s"


def test_key_isolation_salts_every_request_by_its_key() -> None:
    alice, bob = request_cache_salt("key", ALICE, None), request_cache_salt("key", BOB, None)
    assert alice is not None and bob is not None and alice != bob
    assert request_cache_salt("key", ALICE, None) == alice  # one key: one tenant
    # the caller's salt still separates requests of one key, and never joins two keys
    salted = {request_cache_salt("key", k, s) for k in (ALICE, BOB) for s in (None, "s", "t")}
    assert len(salted) == 6
    # a caller cannot name another tenant's salt with a cache_salt of its own
    assert request_cache_salt("key", ALICE, bob) != bob


def test_the_key_and_its_digest_never_travel() -> None:
    salt = request_cache_salt("key", ALICE, "s")
    assert salt is not None
    assert "sk-alice" not in salt and ALICE.hex() not in salt


def test_the_longest_salt_fits_the_wire() -> None:
    salt = request_cache_salt("key", ALICE, "x" * MAX_CACHE_SALT)
    assert salt is not None and len(salt) <= MAX_WIRE_CACHE_SALT


def test_the_matched_keys_digest_names_the_caller() -> None:
    keys = ApiKeys(["sk-alice", "sk-bob"])
    assert keys.match(b"Bearer sk-alice") == ALICE
    assert keys.match(b"Bearer sk-bob") == BOB
    assert keys.match(b"Bearer sk-eve") is None and keys.match(None) is None
    assert ApiKeys([]).match(b"Bearer sk-alice") is None
