"""Which tenant a request's cached prompt blocks belong to.

The prefix cache shares a prompt's KV blocks between requests whose prompts start alike, and
a shared hit shows: `usage.prompt_tokens_details.cached_tokens` counts it and the first token
comes sooner. A caller could probe whether anyone sent a given prompt. `cache_salt` (vLLM's
request field) keeps requests with different salts apart; `--prefix-cache-isolation key` also
salts every request by the caller's API key, so one key's requests never hit another's blocks.
"""

from __future__ import annotations

import hashlib
from typing import Final, Literal

Isolation = Literal["none", "key"]
ISOLATION_MODES: Final[tuple[Isolation, ...]] = ("none", "key")

# Keeps the tenant's salt apart from any other use of the key's digest.
_DOMAIN: Final = b"triode prefix-cache tenant\0"


def request_cache_salt(
    isolation: Isolation, key_digest: bytes | None, cache_salt: str | None
) -> str | None:
    """The salt the engine hashes into the request's first KV block.

    With `key` isolation it names the caller's key (`key_digest`, the SHA-256 the
    authentication matched; a hash of that travels, never the key) and then the caller's own
    `cache_salt`, so that the same salt under two keys still differs. A request without a key
    digest under `key` isolation (the server has no keys: refused at start-up) gets only its
    own salt.
    """
    if isolation != "key" or key_digest is None:
        return cache_salt
    tenant = hashlib.sha256(_DOMAIN + key_digest).hexdigest()
    return f"key {tenant}" if cache_salt is None else f"key {tenant} salt {cache_salt}"
