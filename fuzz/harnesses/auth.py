"""The API key check (`ApiKeys.check`) and the decision which requests need a key
(`requires_auth`, on the path `routed_path` gives the router).

`check` never raises and passes exactly the headers `Bearer <key>` for a configured key, with
optional spaces or tabs around the scheme and the token and any capitalisation of the scheme:
nothing else, whatever the bytes (non-ASCII, control characters, a megabyte of header). No route
under `/v1` is reachable without a key, whatever the path and root path.

Input layout: a mode byte, then the bytes it uses (see `test_one_input`).
"""

from __future__ import annotations

import re

from triode.edge.app import ROUTES, match_route
from triode.edge.auth import OPEN_PATHS, ApiKeys, requires_auth
from triode.edge.routing import routed_path

from .source import ByteSource

KEYS = ["sk-triode-0123456789abcdef", "k", "key with spaces", "Zm9v+/bar=="]
DICTIONARY = [b"Bearer ", b"bearer", b"Basic ", b"\t", b" ", *(key.encode() for key in KEYS)]
_KEYS = ApiKeys(KEYS)
_NONE = ApiKeys([])
_KEY_BYTES = {key.encode() for key in KEYS}
_OWS = b" \t"
_BEARER = re.compile(rb"bearer", re.IGNORECASE)
_AROUND = [b"", b" ", b"\t", b"  ", b"\x0b", b"\x0c", b"\r", b"\n", b"\x1c", b"\x1f", b"\x85",
           b"\xa0", b"\x00", b",", b"=", b"\xe2\x80\x8b"]  # fmt: skip
_SCHEMES = [b"Bearer", b"bearer", b"BEARER", b"bEaReR", b"Basic", b"Bearer:", b"Bear", b"Bearerr",
            b"B\xc3\xa9arer", b"\xef\xbc\xa2earer", b""]  # fmt: skip
_METHODS = ["GET", "POST", "OPTIONS", "options", "HEAD", "PUT", "DELETE", "PATCH", "TRACE", ""]
_PATHS = [*ROUTES, "/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/v1/responses//cancel",
          "/v1/responses/a/b", "/v1", "/v1/", "/V1/models", "//v1/models", "/v1//models",
          "/v1/../health", "/health/../v1/models", "/v1%2Fmodels", "/v1/models/", "/v1/models?x",
          "v1/models", "/v1\x00/models", "/\u0131v1/models", ""]  # fmt: skip


def test_one_input(data: bytes) -> None:
    src = ByteSource(data)
    mode = src.byte() % 6
    if mode == 0:  # raw header bytes
        header: bytes | None = src.rest()
    elif mode == 1:  # a scheme and a token from the bytes
        header = src.choice(_SCHEMES) + src.choice(_AROUND) + src.rest()
    elif mode == 2:  # a real key, dressed
        header = (
            src.choice(_AROUND)
            + src.choice(_SCHEMES)
            + src.choice(_AROUND)
            + src.choice(_AROUND)
            + _mutated_key(src)
            + src.choice(_AROUND)
            + src.choice(_AROUND)
        )
    elif mode == 3:  # a huge header
        header = b"Bearer " + (src.take(256) or b"k") * 4096
    elif mode == 4:
        header = None
    else:
        _check_routes(src)
        return
    _check_header(header)


def _mutated_key(src: ByteSource) -> bytes:
    key = bytearray(src.choice(sorted(_KEY_BYTES)))
    for _ in range(src.int(0, 2)):
        op, pos = src.byte() % 4, src.int(0, len(key))
        if op == 0 and pos < len(key):
            key[pos] ^= 1 << src.int(0, 7)
        elif op == 1:
            key[pos:pos] = src.take(1)
        elif op == 2:
            del key[pos : pos + 1]
        # op 3: unchanged
    return bytes(key)


def expected(header: bytes | None) -> bool:
    """Whether `header` carries a key, restated from RFC 6750 with optional whitespace."""
    if header is None or not header.isascii():
        return False
    scheme, sep, token = header.strip(_OWS).partition(b" ")
    return bool(sep) and _BEARER.fullmatch(scheme) is not None and token.strip(_OWS) in _KEY_BYTES


def _check_header(header: bytes | None) -> None:
    got = _KEYS.check(header)
    assert got is expected(header), f"check({header[:200]!r}) is {got}"
    assert _NONE.check(header) is False


def _check_routes(src: ByteSource) -> None:
    method = src.choice(_METHODS)
    path = src.choice(_PATHS) if src.bool() else src.text(40)
    root = src.choice(["", "/api", "/v1", "/api/"]) if src.bool() else src.text(8)
    scope = {"path": root + path if src.bool() else path, "root_path": root}
    routed = routed_path(scope)
    needs = requires_auth(method, routed)
    assert isinstance(needs, bool)
    handler = (match_route({}, routed) or {}).get(method)  # exact and pattern routes alike
    if handler is not None and routed not in OPEN_PATHS and method != "OPTIONS":
        assert needs, f"{method} {routed!r} reaches a handler without a key"
    if method != "OPTIONS" and (routed == "/v1" or routed.startswith("/v1/")):
        assert needs
