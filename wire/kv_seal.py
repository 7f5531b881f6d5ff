"""Seals on `kv_transfer_params`: only the instances of one deployment speak the KV protocol.

`kv_transfer_params` travel through clients and proxies, so they are untrusted text until
proven otherwise. The instances of a deployment share a secret (`read_secret`); a prefill
instance seals the params it hands on (`seal`: an HMAC-SHA256 over every field, among them a
digest of the prompt's token ids and an expiry), and a decode instance checks the seal and that
the params were made for the prompt it was given (`verify`) before it connects anywhere. The
proxy seals the `do_remote_decode` request it makes of a prefill (`seal_remote_decode`), so a
client cannot make a prefill instance hold blocks for nobody.

The MAC covers a canonical encoding: msgpack of a domain tag and the params' items in key
order, with every value a bounded string, integer, boolean, null or flat list of those, checked
before anything is hashed. A field added or removed in transit breaks the seal like a changed
one. Pure Python and numpy; no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from .private_file import read_private_file

# How to make a secret file; every refusal of one says it.
SECRET_RECIPE = (
    'python -c "import secrets; print(secrets.token_hex(32))" > kv.secret && chmod 600 kv.secret'
)
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096

SEAL = "seal"
ISSUED_AT = "issued_at"
EXPIRES_AT = "expires_at"
PROMPT_DIGEST = "prompt_digest"
NONCE = "nonce"

# Domain tags: a seal made for one purpose never verifies for another.
_PARAMS_DOMAIN = b"triode/kv-transfer-params/v1"
_REMOTE_DECODE_DOMAIN = b"triode/kv-remote-decode/v1"
_PROMPT_DOMAIN = b"triode/kv-prompt/v1"

# Bounds on what is hashed: a prefill's params are a few hundred bytes plus one int per block.
MAX_FIELDS = 64
MAX_STRING = 512
MAX_LIST = 1 << 17  # block ids: a 2M-token context in blocks of 16
_INT_BOUND = 1 << 63
# Clocks of the instances of a deployment may disagree this much (seconds).
MAX_CLOCK_SKEW = 60
# A proxy's `do_remote_decode` seal is good for this long: it is checked when the request
# reaches the prefill's edge, which is at once.
REMOTE_DECODE_TTL = 120

_encoder = msgspec.msgpack.Encoder()


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message is one line and says how to make one."""


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The deployment's secret from `path`: its content without surrounding whitespace.

    Refused (`SecretFileError`), like ssh refuses a private key: a file that is not a regular
    file, that its group or others may read or write, that belongs to another user, or whose
    content is shorter than `MIN_SECRET_BYTES` or longer than `MAX_SECRET_BYTES`.
    """
    how = f"make one with: {SECRET_RECIPE}"
    data = read_private_file(
        path, limit=MAX_SECRET_BYTES, what="secret file", how=how, error=SecretFileError
    )
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(
            f"secret file {path} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are "
            f"needed; {how}"
        )
    return secret


def kv_salt(cache_salt: str | None, lora_name: str | None) -> str | bytes | None:
    """What besides its token ids decides a request's KV, as `prompt_digest` takes it: the
    cache salt alone for a base-model request (its digest is the same as before adapters
    existed), else the salt bound with the LoRA adapter's name, as bytes (a client's salt is
    text, so no salt of a client's reads as a bound one)."""
    if lora_name is None:
        return cache_salt
    return _encoder.encode(("lora", lora_name, cache_salt))


def prompt_digest(
    token_ids: Sequence[int] | np.ndarray, cache_salt: str | bytes | None = None
) -> str:
    """SHA-256 (hex) of what decides a prompt's KV: its token ids as int32, and its cache salt
    when it has one (requests with different salts never share KV): text, a client's, or
    bytes, the salt bound with a LoRA adapter (`kv_salt`), so that params made for one
    adapter's prompt are made for another prompt under any other. ValueError for a token id
    outside int32."""
    try:
        ids = np.asarray(token_ids, dtype=np.int32)
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"token ids must be int32: {e}") from None
    h = hashlib.sha256(_PROMPT_DOMAIN)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        text = isinstance(cache_salt, str)
        salt = cache_salt.encode() if text else bytes(cache_salt)
        h.update((b"\x01" if text else b"\x02") + len(salt).to_bytes(8, "little") + salt)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.astype("<i4", copy=False).tobytes())
    return h.hexdigest()


def seal(
    secret: bytes,
    params: dict[str, Any],
    prompt_digest: str,
    *,
    ttl: float,
    now: float | None = None,
) -> dict[str, Any]:
    """`params` (a producer's, for a decode instance) with the prompt's digest, an issue time,
    an expiry `ttl` seconds later and the seal over all of them. ValueError when a value is
    not one a seal covers (see `canonical_problem`)."""
    issued = int(time.time() if now is None else now)
    sealed = {
        **params,
        PROMPT_DIGEST: prompt_digest,
        ISSUED_AT: issued,
        EXPIRES_AT: issued + max(1, int(-(-ttl // 1))),
    }
    sealed.pop(SEAL, None)
    return {**sealed, SEAL: _mac(secret, _PARAMS_DOMAIN, sealed)}


def verify(
    secret: bytes, params: Any, prompt_digest: str, *, now: float | None = None
) -> str | None:
    """What is wrong with sealed `params` for the prompt whose digest is `prompt_digest`, or
    None when this deployment sealed them, for that prompt, and they have not expired. Never
    raises for any JSON-like `params`."""
    problem = _check(secret, _PARAMS_DOMAIN, params, now)
    if problem is not None:
        return problem
    digest = params.get(PROMPT_DIGEST)
    if not isinstance(digest, str) or not hmac.compare_digest(
        digest.encode(), prompt_digest.encode()
    ):
        return "kv_transfer_params: made for another prompt"
    return None


def seal_remote_decode(
    secret: bytes,
    params: dict[str, Any],
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> dict[str, Any]:
    """A proxy's `do_remote_decode` params for a prefill instance, with a nonce (fresh unless
    given, for a reproducible seal), an issue time, an expiry and the seal."""
    issued = int(time.time() if now is None else now)
    sealed = {
        **params,
        NONCE: os.urandom(16).hex() if nonce is None else nonce,
        ISSUED_AT: issued,
        EXPIRES_AT: issued + REMOTE_DECODE_TTL,
    }
    sealed.pop(SEAL, None)
    return {**sealed, SEAL: _mac(secret, _REMOTE_DECODE_DOMAIN, sealed)}


def verify_remote_decode(secret: bytes, params: Any, *, now: float | None = None) -> str | None:
    """What is wrong with a `do_remote_decode` request's params, or None when this
    deployment's proxy sealed them and they have not expired. Never raises."""
    return _check(secret, _REMOTE_DECODE_DOMAIN, params, now)


def canonical_problem(params: Any) -> str | None:
    """Why `params` cannot be sealed or checked (too many fields, a value too long or of a
    kind no seal covers), or None. Runs before anything is hashed, so its cost is bounded."""
    if not isinstance(params, dict):
        return "kv_transfer_params: must be an object"
    if len(params) > MAX_FIELDS:
        return f"kv_transfer_params: more than {MAX_FIELDS} fields"
    for key, value in params.items():
        if not isinstance(key, str) or len(key) > MAX_STRING:
            return "kv_transfer_params: a field name is not a short string"
        if isinstance(value, list):
            if len(value) > MAX_LIST:
                return f"kv_transfer_params: {key} has more than {MAX_LIST} items"
            if not all(_scalar_ok(item) for item in value):
                return f"kv_transfer_params: {key} must hold short strings or 64-bit integers"
        elif not _scalar_ok(value):
            return f"kv_transfer_params: {key} must be a short string, 64-bit integer or list"
    return None


def _scalar_ok(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -_INT_BOUND <= value < _INT_BOUND
    if isinstance(value, str):
        return len(value) <= MAX_STRING
    return False


def _mac(secret: bytes, domain: bytes, params: dict[str, Any]) -> str:
    problem = canonical_problem(params)
    if problem is not None:
        raise ValueError(problem)
    # A tuple of sorted (key, value) pairs: one encoding for one meaning, whatever order the
    # fields took through JSON.
    body = _encoder.encode((domain, sorted(params.items())))
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def _check(secret: bytes, domain: bytes, params: Any, now: float | None) -> str | None:
    problem = canonical_problem(params)
    if problem is not None:
        return problem
    given = params.get(SEAL)
    if given is None:
        return "kv_transfer_params: not sealed; only this deployment's instances make them"
    if not isinstance(given, str):
        return "kv_transfer_params: seal must be a string"
    unsealed = {k: v for k, v in params.items() if k != SEAL}
    if not hmac.compare_digest(given.encode(), _mac(secret, domain, unsealed).encode()):
        return (
            "kv_transfer_params: the seal does not match (altered, or made by another deployment)"
        )
    issued, expires = params.get(ISSUED_AT), params.get(EXPIRES_AT)
    if not (_is_int(issued) and _is_int(expires)):
        return "kv_transfer_params: no issue time and expiry"
    clock = time.time() if now is None else now
    if issued > clock + MAX_CLOCK_SKEW:
        return "kv_transfer_params: issued in the future (are the instances' clocks set?)"
    if clock > expires:
        return "kv_transfer_params: expired"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
