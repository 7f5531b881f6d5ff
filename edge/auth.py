"""Bearer-token authentication against SHA-256 hashes of the configured API keys."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping
from typing import Final

ENV_VAR: Final = "TRIODE_API_KEY"

_OWS: Final = " \t"

# Sent with every 401 (RFC 6750).
UNAUTHORIZED_HEADERS: Final[list[tuple[bytes, bytes]]] = [(b"www-authenticate", b"Bearer")]


class ApiKeys:
    """The accepted API keys, held only as SHA-256 digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(key.encode()) for key in keys if key)

    @classmethod
    def from_digests(cls, digests: Iterable[bytes]) -> ApiKeys:
        """Keys given as their digests (`digests`): how they reach another process."""
        keys = cls(())
        keys._digests = tuple(digests)
        return keys

    @property
    def digests(self) -> tuple[bytes, ...]:
        return self._digests

    @property
    def enabled(self) -> bool:
        """Whether any key is configured; with none, the server is open."""
        return bool(self._digests)

    def check(self, authorization: bytes | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys. Never raises."""
        return self.match(authorization) is not None

    def match(self, authorization: bytes | None) -> bytes | None:
        """The digest of the key an `Authorization` header value carries, if it is one of the
        keys (None otherwise): what names the caller without holding its key. Never raises.

        The token is compared with every stored digest, match or not, so the time taken does
        not tell which key (or how many) came close.
        """
        token = _bearer_token(authorization)
        if token is None:
            return None
        digest = _digest(token)
        matched = False
        for stored in self._digests:
            matched |= secrets.compare_digest(digest, stored)
        return digest if matched else None


# The routes anyone may call: liveness, the version, and (unless the operator puts it behind
# the key) the Prometheus scrape. Every other path needs a key, routed or not, so a route added
# later (an admin route outside /v1, say) is guarded without a second thought.
OPEN_PATHS: Final = frozenset({"/health", "/version", "/metrics"})


def paths_without_key(*, metrics_require_key: bool = False) -> frozenset[str]:
    """The paths served without a key: `OPEN_PATHS`, less `/metrics` when it needs one."""
    return OPEN_PATHS - {"/metrics"} if metrics_require_key else OPEN_PATHS


def requires_auth(method: str, path: str, open_paths: frozenset[str] = OPEN_PATHS) -> bool:
    """Whether a request needs a key: every path but those in `open_paths` (matched exactly),
    and CORS preflights (OPTIONS), which answer with no data.

    `path` must be the very string the router matches (root_path already stripped). It is not
    normalised here; the router must not normalise it either, or a path could reach a protected
    handler without passing this check. Unrouted paths need a key too (a 401, not a 404).
    """
    if method == "OPTIONS":
        return False
    return path not in open_paths


def keys_from(cli_keys: list[str] | None, env: Mapping[str, str]) -> list[str]:
    """The keys from `--api-key` (one per flag) and `TRIODE_API_KEY` (comma-separated).

    Keys are stripped; empty ones and repeats are dropped, first occurrence kept.
    """
    candidates = list(cli_keys or [])
    candidates += env.get(ENV_VAR, "").split(",")
    stripped = (key.strip() for key in candidates)
    return list(dict.fromkeys(key for key in stripped if key))


def _bearer_token(authorization: bytes | None) -> bytes | None:
    if authorization is None:
        return None
    try:
        value = authorization.decode("ascii")
    except UnicodeDecodeError:
        return None
    # Only HTTP's optional whitespace (spaces, tabs) surrounds the scheme and the token:
    # str.strip() would also drop control characters such as \x1c-\x1f, \v and \f.
    scheme, sep, token = value.strip(_OWS).partition(" ")
    token = token.strip(_OWS)
    if not sep or scheme.lower() != "bearer" or not token:
        return None
    return token.encode("ascii")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
