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
"""

from __future__ import annotations

import functools
import logging
import re

import msgspec

from .http import Request

log = logging.getLogger(__name__)

HEADER = b"triode-ignored-fields"
# Names longer than this, or with characters outside these, are left out of the header and
# the log: a field name is client text, and a header value must not carry line breaks.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
MAX_LISTED = 16  # names in one response's header
MAX_LOGGED = 256  # distinct names logged by one process; a client inventing names logs no more

_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])
_logged: set[str] = set()


def ignored_fields(body: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of the JSON object `body` that `kind` has no field for, in the
    order given. `body` must already have decoded as `kind`."""
    known = _known(kind)
    return [name for name in _keys.decode(body) if name not in known]


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
def _known(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(field.encode_name for field in msgspec.structs.fields(kind))
