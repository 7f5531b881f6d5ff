"""Top-level fields of an OpenAI request body that triode does not know.

Routers and gateways re-serialize the bodies they forward and add fields of their own
(vllm-router adds `no_stop_trim`, `return_hidden_states`, `separate_reasoning`, ...), and
client libraries grow new fields faster than servers learn them. vLLM accepts such a request
and logs the fields it ignored; so does triode on the OpenAI endpoints (chat, completions,
responses, tokenize, detokenize), and it also says so to the client: the response carries a
`triode-ignored-fields` header naming them. The admin endpoints stay strict: a mistyped field in
an operator's command must not silently do something else.

What is ignored never goes further than this module: the typed decode drops it, and the body
limit counts it like any other byte. Nested objects (messages, content parts) stay strict.

A body is decoded strictly first, which costs nothing more when every field is known (the
common case). Only when the strict decode stops at an unknown top-level field is it decoded
again without them, and its keys listed: all of them for a body of at most `MAX_SCANNED`
bytes, else just the first (listing every key of a large body of tiny ones would cost many
times its decode).
"""

from __future__ import annotations

import functools
import logging
import re
import types
from typing import TypeVar

import msgspec

from .errors import APIError, validation_error
from .http import Request

log = logging.getLogger(__name__)

HEADER = b"triode-ignored-fields"
# Names longer than this, or with characters outside these, are left out of the header and
# the log: a field name is client text, and a header value must not carry line breaks.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
MAX_LISTED = 16  # names in one response's header
MAX_LOGGED = 256  # distinct names logged by one process; a client inventing names logs no more
MAX_SCANNED = 64 << 10  # bodies whose every unknown key is listed

_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])
_logged: set[str] = set()
_UNKNOWN_AT_TOP = re.compile(r"Object contains unknown field `(.*)`\Z", re.S)

_BodyT = TypeVar("_BodyT", bound=msgspec.Struct)


def decode_request_body(body: bytes, kind: type[_BodyT], http: Request | None) -> _BodyT:
    """`body` as a `kind`, its ignored top-level fields announced on `http`'s response; any
    failure is a 400 `APIError` naming the field."""
    try:
        request, ignored = decode_body(body, kind)
    except (msgspec.DecodeError, ValueError) as e:
        raise validation_error(e) from e
    except RecursionError:  # msgspec's limit on nesting in `Any` fields
        raise APIError(400, "invalid JSON: nested too deeply") from None
    if http is not None:
        announce(http, ignored)
    return request


def decode_body(body: bytes, kind: type[_BodyT]) -> tuple[_BodyT, list[str]]:
    """`body` as a `kind`, and the top-level fields it ignored (see the module's docstring).
    Raises what msgspec's decoders raise for anything else wrong with it."""
    strict, lenient = _decoders(kind)
    try:
        return strict.decode(body), []
    except msgspec.ValidationError as e:
        unknown = _UNKNOWN_AT_TOP.match(str(e))
        if unknown is None:
            raise
    request = lenient.decode(body)
    if len(body) > MAX_SCANNED:
        return request, [unknown.group(1)]
    known = _known(kind)
    return request, [name for name in _keys.decode(body) if name not in known]


def announce(request: Request, names: list[str]) -> None:
    """Name the ignored fields in the response's header, and in the log the first time each
    is seen."""
    listed = [name for name in names if _NAME.match(name)][:MAX_LISTED]
    if not listed:
        return
    request.response_headers.append((HEADER, ", ".join(listed).encode("ascii")))
    new = [name for name in listed if name not in _logged]
    if new and len(_logged) < MAX_LOGGED:
        _logged.update(new)
        log.info(
            "%s: ignored request fields %s (logged once per field name)",
            request.path,
            ", ".join(new),
        )


@functools.cache
def _decoders(
    kind: type[_BodyT],
) -> tuple[msgspec.json.Decoder[_BodyT], msgspec.json.Decoder[_BodyT]]:
    """A strict decoder of `kind` (a subclass that refuses unknown fields), and `kind`'s own."""
    strict = types.new_class(kind.__name__, (kind,), {"forbid_unknown_fields": True})
    return msgspec.json.Decoder(strict), msgspec.json.Decoder(kind)


@functools.cache
def _known(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(field.encode_name for field in msgspec.structs.fields(kind))
