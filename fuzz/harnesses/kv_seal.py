"""Sealed `kv_transfer_params` against mutation: no change to sealed params is ever accepted,
and no JSON value makes a check raise.

Each input is one mode byte and JSON text, the params as a client or proxy would send them.
Bit 1 of the mode picks the seal checked: a prefill's params for a decode (`verify`, and the
connector's `seal_error` for the prompt they were made for) or the proxy's `do_remote_decode`
(`verify_remote_decode`). Without bit 0, nothing but the very params sealed here may pass:
every other value is refused with a reason, and the seeds are those params, so the mutations
are near misses. With bit 0 the input is sealed again with the deployment's secret as given,
so that the mutations reach past the MAC to the checks behind it (expiry, issue time, prompt
digest, the params' shape), which must hold for whatever passes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from triode.actors.kv_params import seal_error, transfer_params_error
from triode.wire import kv_seal
from triode.wire.kv_seal import prompt_digest, seal, seal_remote_decode, verify
from triode.wire.kv_seal import verify_remote_decode as verify_ask

SECRET = b"fuzz-deployment-secret-0123456789"
NOW = 1_800_000_000
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(45)]
DIGEST = prompt_digest(PROMPT)
RESEAL, ASK = 1, 2

PARAMS = seal(
    SECRET,
    {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "cmpl-1",
        "remote_block_ids": [4, 5, 6],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_endpoints": ["tcp://127.0.0.1:5600"],
        "remote_num_tokens": len(PROMPT),
        "remote_secret": "per-request",
        "tp_size": 1,
        "pp_size": 1,
        "block_size": 16,
        "transport": "tcp",
    },
    DIGEST,
    ttl=120,
    now=NOW,
)
ASKED = seal_remote_decode(
    SECRET, {"do_remote_decode": True, "do_remote_prefill": False}, now=NOW, nonce="00" * 16
)

DICTIONARY = [b'"seal"', b'"prompt_digest"', b'"issued_at"', b'"expires_at"', b'"nonce"',
              b'"remote_block_ids"', b'"remote_endpoints"', b'"do_remote_prefill"',
              b'"do_remote_decode"', b"18446744073709551616", b"9223372036854775807",
              b"-9223372036854775809", b"true", b"false", b"null", b"[]", b"{}", b"[[]]",
              b'"tcp://10.0.0.1:1"', b"1800000000", b"1799999999", b"1.5"]  # fmt: skip


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, text = data[0], data[1:]
    try:
        params = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # the edge's body decoder refuses these
        return
    if mode & RESEAL:
        params = _sealed_again(params, mode)
        if params is None:
            return
    if mode & ASK:
        problem = _checked(verify_ask(SECRET, params, now=NOW))
        if problem is None and not mode & RESEAL:
            assert _same(params, ASKED), f"accepted altered do_remote_decode params: {params}"
        if problem is None:
            _assert_fresh(params)
        return
    problem = _checked(verify(SECRET, params, DIGEST, now=NOW))
    _checked(transfer_params_error(params))
    connector = _checked(seal_error(SECRET, params, PROMPT, now=NOW))
    if problem is None and not mode & RESEAL:
        assert _same(params, PARAMS), f"accepted altered params: {params}"
    if problem is None:
        assert params[kv_seal.PROMPT_DIGEST] == DIGEST, "accepted params for another prompt"
        _assert_fresh(params)
    if connector is None and not isinstance(params, dict):
        assert not params, "the connector accepted params that are no object"
        return
    if connector is None and params.get("do_remote_prefill"):
        assert problem is None, "the connector accepted params the seal refuses"
        assert transfer_params_error(params) is None
    if connector is None and params.get("do_remote_decode") and not mode & RESEAL:
        assert _same(params, ASKED), f"the connector accepted altered params: {params}"


def _sealed_again(params: Any, mode: int) -> dict[str, Any] | None:
    """`params` with a seal made here over its fields as they are (issue time and expiry
    included, unlike `seal`, which sets its own), or None when they are no sealable object."""
    if kv_seal.canonical_problem(params) is not None:
        return None
    unsealed = {k: v for k, v in params.items() if k != kv_seal.SEAL}
    domain = kv_seal._REMOTE_DECODE_DOMAIN if mode & ASK else kv_seal._PARAMS_DOMAIN
    return {**unsealed, kv_seal.SEAL: kv_seal._mac(SECRET, domain, unsealed)}


def _checked(problem: Any) -> str | None:
    assert problem is None or (isinstance(problem, str) and problem), repr(problem)
    return problem


def _assert_fresh(params: dict[str, Any]) -> None:
    issued, expires = params[kv_seal.ISSUED_AT], params[kv_seal.EXPIRES_AT]
    assert type(issued) is int and type(expires) is int
    assert issued <= NOW + kv_seal.MAX_CLOCK_SKEW and NOW <= expires


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal field by field, types included (JSON's true is not its 1)."""
    return msgspec.msgpack.encode(sorted(a.items())) == msgspec.msgpack.encode(sorted(b.items()))


def seeds() -> list[bytes]:
    """The sealed params in each mode, and near misses: unsealed, altered, expired, huge."""
    params, asked = msgspec.json.encode(PARAMS), msgspec.json.encode(ASKED)
    unsealed = {k: v for k, v in PARAMS.items() if k != kv_seal.SEAL}
    variants = [
        unsealed,
        {**PARAMS, "remote_block_ids": [4, 5, 7]},
        {**PARAMS, "remote_num_tokens": 2**64},
        {**PARAMS, "expires_at": NOW - 1},
        {**PARAMS, "prompt_digest": prompt_digest(PROMPT[:-1])},
        {**PARAMS, "extra": {"nested": [[1]]}},
    ]
    return [
        bytes([0]) + params,
        bytes([RESEAL]) + params,
        bytes([ASK]) + asked,
        bytes([ASK | RESEAL]) + asked,
        *(bytes([mode]) + msgspec.json.encode(v) for v in variants for mode in (0, RESEAL)),
        b"\x00[1, 2]",
        b"\x02null",
        b"\x01" + b"[" * 2000,
    ]
