"""The checks of a request's `kv_transfer_params` that need no engine: their shape
(`transfer_params_error`), and whether this deployment sealed them for this very prompt
(`seal_error`).

A client of the engine makes them before a request leaves it (`Engine.generate`, the edge), and
the KV connector's scheduler side (`core/kv_connector.py`) makes them again where it acts on the
params. The params are a cluster protocol, not a client feature (`triode.wire.kv_seal`).
"""

from __future__ import annotations

from typing import Any

from triode.wire import kv_seal
from triode.wire.kv_transfer import TRANSPORTS

# the params a decode request must carry, beyond do_remote_prefill
_REMOTE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_endpoints": list,
    "remote_num_tokens": int,
    "remote_secret": str,
    "tp_size": int,
    "pp_size": int,
    "block_size": int,
    "transport": str,
}


def transfer_params_error(params: Any) -> str | None:
    """What is wrong with a request's `kv_transfer_params`, or None: the shape check the edge
    makes before a request reaches an engine, total over any JSON value (bounded sizes, 64-bit
    integers). Whether the params are sealed for this prompt is checked where the prompt's
    tokens are known (`seal_error`); whether an engine can use them (its layout) is its own
    decision, and it recomputes where it cannot."""
    if not params:
        return None
    problem = kv_seal.canonical_problem(params)
    if problem is not None:
        return problem
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(flag, False), bool):
            return f"kv_transfer_params.{flag} must be a boolean"
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        return "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other"
    if not params.get("do_remote_prefill"):
        return None
    for name, kind in _REMOTE_FIELDS.items():
        value = params.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"kv_transfer_params.{name} is required with do_remote_prefill"
    if not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0
        for b in params["remote_block_ids"]
    ):
        return "kv_transfer_params.remote_block_ids must be block ids (ints >= 0)"
    if not all(isinstance(e, str) and e.startswith("tcp://") for e in params["remote_endpoints"]):
        return "kv_transfer_params.remote_endpoints must be tcp:// addresses"
    if params["transport"] not in TRANSPORTS:
        return f"kv_transfer_params.transport must be one of {', '.join(TRANSPORTS)}"
    for name in ("remote_num_tokens", "tp_size", "pp_size", "block_size"):
        if params[name] < 1:
            return f"kv_transfer_params.{name} must be >= 1"
    return None


def seal_error(
    secret: bytes,
    params: dict[str, Any] | None,
    prompt_token_ids: list[int],
    cache_salt: str | bytes | None = None,
    *,
    now: float | None = None,
) -> str | None:
    """Why this deployment must not act on `params` for this prompt, or None.

    `do_remote_prefill` params must carry the seal of this deployment's prefill, made for this
    very prompt (its token ids as tokenized here, and its cache salt); `do_remote_decode`
    params the seal of its proxy. Other params ask for nothing and need none. Never raises.
    """
    problem = transfer_params_error(params)
    if problem is not None or not params:
        return problem
    if params.get("do_remote_prefill"):
        try:
            digest = kv_seal.prompt_digest(prompt_token_ids, cache_salt)
        except ValueError as e:
            return f"kv_transfer_params: {e}"
        return kv_seal.verify(secret, params, digest, now=now)
    if params.get("do_remote_decode"):
        return kv_seal.verify_remote_decode(secret, params, now=now)
    return None
