"""The KV server's request decoding on hostile frames: every frame gets a reply ("ok",
"unknown" or "refused"), never an exception, and "ok" only for what the exposure allows.

Each input is one mode byte and a frame. The frame goes to a live `KVServer`'s answer (its ZMQ
path) or, with bit 1 of the mode, to its shared-memory hand-off's. With bit 0, a frame that
decodes as a `KVRequest` is first signed with the deployment's secret, so that the mutations
reach past the MAC to the checks behind it (ops, transports, engine and request ids, block
lists); without it, only the MAC check and the decoder see the input, and nothing may pass.
One server serves every input, as one serves every decode rank, so state a bad request leaves
behind shows up in later inputs.
"""

from __future__ import annotations

import atexit

import msgspec
import torch
import zmq

from triode.gpu.kv.shm import shared_cache
from triode.gpu.kv.transport import KVServer, RequestAuth
from triode.wire.kv_transfer import DONE, READ, KVExpose, KVReply, KVRequest

SECRET = b"k" * 32
ENGINE = "engine"
EXPOSED = KVExpose("r", [1, 2, 3], "s")
NUM_BLOCKS = 8
SHAPE = (2, 2, NUM_BLOCKS, 4, 1, 2)  # layers, K/V, blocks, block size, heads, head dim
SIGN, HANDOFF = 1, 2

DICTIONARY = [b"\xa4read", b"\xa4done", b"\xa3tcp", b"\xa3shm", b"\xa6engine", b"\xa1r",
              b"\xa1s", b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00"
              b"\x00\x00", b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xdc\xff\xff",
              b"\xc4\x20", b"\x93\x01\x02\x03", b"\x92\x01\x01"]  # fmt: skip


class _Server:
    def __init__(self) -> None:
        cache, self.fd = shared_cache(SHAPE, torch.float32)
        cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(SHAPE))
        self.server = KVServer(
            "tcp://127.0.0.1:*", cache, engine_id=ENGINE, secret=SECRET, shm_fd=self.fd
        )
        self.auth = RequestAuth(SECRET)
        self.decoder = msgspec.msgpack.Decoder(KVRequest)
        atexit.register(self.close)

    def close(self) -> None:
        self.server.close()


_server: _Server | None = None  # opened by the first input, so that importing opens nothing


def test_one_input(data: bytes) -> None:
    global _server
    if _server is None:
        _server = _Server()
    s, server = _server, _server.server
    if not data:
        return
    mode, frame = data[0], data[1:]
    request: KVRequest | None = None
    if mode & SIGN:
        try:
            request = s.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            request = None
        else:
            frame = msgspec.msgpack.encode(s.auth.sign(request))
    server.take_done()
    server.expose([EXPOSED])
    errors = server.protocol_errors
    if mode & HANDOFF:
        answer, granted = server._hand_off(frame)
        reply = msgspec.msgpack.decode(answer, type=KVReply)
        payload: list[memoryview] = []
        assert granted == (reply.status == "ok")
    else:
        reply, payload = server._answer([zmq.Frame(frame)])
    assert reply.status in ("ok", "unknown", "refused"), reply
    assert (server.protocol_errors > errors) == (reply.status == "refused"), reply
    if reply.status != "ok":
        assert not payload
        return
    assert request is not None, "an unsigned frame was answered"
    assert request.engine_id == ENGINE and request.request_id == EXPOSED.request_id
    assert request.secret == EXPOSED.secret
    if request.op == DONE:
        assert not mode & HANDOFF and not payload
        return
    assert request.op == READ
    ids = request.block_ids
    assert ids and len(set(ids)) == len(ids) and set(ids) <= set(EXPOSED.block_ids)
    if request.transport == "tcp":
        assert not mode & HANDOFF
        assert [bytes(p) for p in payload] == [
            server.cache[:, :, b].contiguous().view(torch.uint8).numpy().tobytes() for b in ids
        ]
    else:
        assert request.transport == "shm" and not payload
        assert mode & HANDOFF or (reply.shm is not None and reply.shm.path)


def seeds() -> list[bytes]:
    """Requests of every shape the server must answer or refuse, signed and not."""
    good = KVRequest(READ, 1, ENGINE, "r", "s", [1, 2])
    shapes = [
        good,
        KVRequest(READ, 2, ENGINE, "r", "s", [3], transport="shm"),
        KVRequest(DONE, 3, ENGINE, "r", "s"),
        KVRequest(READ, 4, ENGINE, "r", "s", []),
        KVRequest(READ, 5, ENGINE, "r", "s", [1, 1]),
        KVRequest(READ, 6, ENGINE, "r", "s", [NUM_BLOCKS]),
        KVRequest(READ, 7, ENGINE, "r", "s", [-1]),
        KVRequest(READ, 8, ENGINE, "r", "s", [5]),
        KVRequest("write", 9, ENGINE, "r", "s", [1]),
        KVRequest(READ, 10, ENGINE, "r", "s", [1], transport="rdma"),
        KVRequest(READ, 11, "other", "r", "s", [1]),
        KVRequest(READ, 12, ENGINE, "r", "wrong", [1]),
        KVRequest(READ, 13, ENGINE, "gone", "s", [1]),
    ]
    frames = [msgspec.msgpack.encode(r) for r in shapes]
    return (
        [bytes([SIGN]) + f for f in frames]
        + [bytes([SIGN | HANDOFF]) + f for f in frames[:3]]
        + [b"\x00" + frames[0], b"\x02" + frames[1], b"\x01", b"\x01\x90", b"\x00\xc1"]
    )
