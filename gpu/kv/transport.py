"""The KV connector's transports, prefill side: one rank's KV server, and what both sides share
(the geometry, the requests' authentication).

The server runs on a thread of its own beside the step loop, with its own ZMQ socket, so no
transfer ever blocks a step. Messages are `triode.wire.kv_transfer`'s: a decode rank's DEALER
sends a `KVRequest`, the prefill rank's ROUTER answers with a `KVReply`. Only the deployment's
instances speak it: every request carries an HMAC keyed from the deployment's secret
(`RequestAuth`), checked before anything else, and good once within a window of its timestamp.

- **tcp**: the reply to READ carries the blocks, one frame per block (every layer's K and V,
  block-major), sent zero-copy from a gathered copy of the cache.
- **shm**: the prefill rank's whole cache lives in a memfd; the reply to READ names the unix
  socket (`shm.CacheHandoff`) where the reader asks again, authenticated, for the fd, and
  the reader copies the blocks it was told of straight out of a private (copy-on-write) mapping.

Consistency: a request's blocks are readable only while exposed. DONE ends that (the reader is
through) and is acknowledged only if the blocks were still exposed, and the scheduler frees
blocks only after DONE or after withdrawing them (`release`, applied before the forward that
could reuse them). So a reader that gets its DONE acknowledged read blocks nobody had
overwritten; one that does not discards what it read.

The server never dies of what a peer sends: an undecodable or unauthenticated request, a wrong
op, engine or transport, an empty, repeated or out-of-range block list, or any error while
answering is a refused request counted in `protocol_errors`, and the next one is served.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

import msgspec
import torch
import zmq

from triode.wire.kv_seal import MAX_CLOCK_SKEW
from triode.wire.kv_transfer import (
    DONE,
    READ,
    TRANSPORTS,
    KVExpose,
    KVGeometry,
    KVReply,
    KVRequest,
    KVShmRef,
)

from .shm import CacheHandoff

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a KVRequest names block ids, a reply's header is small: anything larger is hostile, refused
# and counted up to CUT_BYTES, past which ZMQ drops the sender before buffering the frame
MAX_REQUEST_BYTES = 1 << 20
CUT_BYTES = 2 * MAX_REQUEST_BYTES
# seconds a request is good for either side of its timestamp: the clocks of a deployment's
# hosts may disagree as much as its seals allow, and a reader re-signs every attempt
REPLAY_WINDOW = float(MAX_CLOCK_SKEW)
_POLL_MS = 50  # how often the server looks at its stop flag
_KEY_DOMAIN = b"triode/kv-request/v1"
_PRUNE_AT = 4096  # seen MACs kept before the expired ones are dropped
_LOG_EVERY = 10.0  # seconds between warnings of refused requests: a peer cannot flood the log


class TransferError(Exception):
    """A load that cannot complete; `protocol` when a peer's message was malformed."""

    def __init__(self, message: str, *, protocol: bool = False) -> None:
        super().__init__(message)
        self.protocol = protocol


def geometry_of(cache: torch.Tensor) -> KVGeometry:
    """The geometry of a cache shaped [layers, 2, blocks, block_size, kv_heads, head_dim]."""
    layers, _, _, block_size, heads, dim = cache.shape
    return KVGeometry(layers, block_size, heads, dim, str(cache.dtype).removeprefix("torch."))


def block_bytes(geometry: KVGeometry) -> int:
    numel = 1
    for n in geometry.block_shape:
        numel *= n
    return numel * DTYPES[geometry.dtype].itemsize


class RequestAuth:
    """Signs a decode rank's `KVRequest`s and checks them on a prefill's server.

    The MAC is HMAC-SHA256, keyed with a subkey of the deployment's secret (so it never verifies
    a seal made with the secret itself), over the whole request encoded with `mac` empty: op,
    nonce, engine and request ids, the per-request secret, block ids, transport and timestamp.
    A request is good within `window` seconds of its timestamp, and once: the MACs seen stay
    remembered until their window has passed. Thread-safe.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        window: float = REPLAY_WINDOW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = hmac.new(secret, _KEY_DOMAIN, hashlib.sha256).digest()
        self.window = window
        self.clock = clock
        self._seen: dict[bytes, float] = {}  # MAC -> when it can be forgotten
        self._prune_at = _PRUNE_AT
        self._lock = threading.Lock()

    def sign(self, request: KVRequest) -> KVRequest:
        """`request`, stamped with the time and its MAC (in place)."""
        request.timestamp = self.clock()
        request.mac = b""
        request.mac = self._mac(request)
        return request

    def check(self, request: KVRequest) -> str | None:
        """Why `request` is not one of this deployment's, fresh and first seen; None if it is."""
        given = request.mac
        request.mac = b""
        expected = self._mac(request)
        request.mac = given
        if not hmac.compare_digest(given, expected):
            return "the request's MAC does not match: not signed with this deployment's secret"
        now = self.clock()
        if not math.isfinite(request.timestamp) or abs(now - request.timestamp) > self.window:
            return f"the request is outside the {self.window:g}s window of its timestamp"
        with self._lock:
            if given in self._seen:
                return "the request was replayed"
            if len(self._seen) >= self._prune_at:
                self._seen = {m: t for m, t in self._seen.items() if t > now}
                self._prune_at = max(_PRUNE_AT, 2 * len(self._seen))
            self._seen[given] = request.timestamp + self.window
        return None

    def _mac(self, request: KVRequest) -> bytes:
        return hmac.new(self._key, msgspec.msgpack.encode(request), hashlib.sha256).digest()


class KVServer:
    """Serves one prefill rank's exposed blocks to the decode ranks that ask.

    Who can reach it: anyone who can reach `bind` (the config's `kv_ip`, loopback by default);
    what it does for them: nothing before the request's MAC checks out. The largest input it
    reads is a frame of `CUT_BYTES` (ZMQ cuts a peer that sends more), refused past
    `MAX_REQUEST_BYTES` without being decoded; the largest
    answer, the blocks of one exposed request, goes only to a request that checks out.
    """

    def __init__(
        self,
        bind: str,
        cache: torch.Tensor,
        *,
        engine_id: str,
        secret: bytes,
        shm_fd: int | None = None,
    ) -> None:
        self.cache = cache
        self.geometry = geometry_of(cache)
        self.num_blocks = cache.shape[2]
        self.engine_id = engine_id
        self.auth = RequestAuth(secret)
        self.protocol_errors = 0
        self.blocks_sent = 0
        self._quiet_until = 0.0
        self._unlogged = 0
        self._exposed: dict[str, KVExpose] = {}
        self._done: list[str] = []
        self._lock = threading.Lock()
        self._errors_lock = threading.Lock()  # refusals are counted under `_lock` too
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, CUT_BYTES)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(KVRequest)
        self._handoff_decoder = msgspec.msgpack.Decoder(KVRequest)  # its own thread's
        self._encoder = msgspec.msgpack.Encoder()
        self.handoff = (
            None if shm_fd is None else CacheHandoff(shm_fd, self._hand_off, self._count_error)
        )
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def expose(self, items: Iterable[KVExpose]) -> None:
        with self._lock:
            for item in items:
                self._exposed[item.request_id] = item

    def release(self, request_ids: Iterable[str]) -> None:
        """Withdraw requests' blocks; returns once no read of them is under way."""
        with self._lock:
            for request_id in request_ids:
                self._exposed.pop(request_id, None)

    def take_done(self) -> list[str]:
        """Requests whose reader said DONE since the last call."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()
        if self.handoff is not None:
            self.handoff.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(_POLL_MS):
                    continue
                identity, *frames = self._socket.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                log.warning("the KV server could not receive: %s", e)
                continue
            try:
                header, payload = self._answer(frames)
                self._socket.send_multipart(
                    [identity, self._encoder.encode(header), *payload], copy=False
                )
            except Exception as e:  # ours, or a peer's doing: the thread serves on
                self._count_error(f"a KV request it failed to answer: {e!r}")

    def _answer(self, frames: list[zmq.Frame]) -> tuple[KVReply, list[memoryview]]:
        if len(frames) != 1:
            return self._undecodable(f"{len(frames)} frames, not 1"), []
        if len(frames[0].buffer) > MAX_REQUEST_BYTES:
            return self._undecodable(f"a frame of more than {MAX_REQUEST_BYTES} bytes"), []
        try:
            request = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._undecodable(str(e)), []
        reply = self._vet(request)
        if reply is not None:
            return reply, []
        with self._lock:
            reply = self._lookup(request)
            if reply is not None:
                return reply, []
            if request.op == DONE:
                del self._exposed[request.request_id]
                self._done.append(request.request_id)
                return KVReply(request.nonce, "ok"), []
            reply = KVReply(request.nonce, "ok", geometry=self.geometry)
            if request.transport == "shm":
                if self.handoff is None:
                    return self._refuse(request, "this server's cache is not in shared memory"), []
                reply.shm = KVShmRef(
                    0, 0, self.num_blocks, path=self.handoff.path, size=self.handoff.size
                )
                return reply, []
            # one copy, block-major, made before the lock lets a release (and reuse) through
            ids = torch.tensor(request.block_ids, dtype=torch.int64, device=self.cache.device)
            blocks = self.cache.permute(2, 0, 1, 3, 4, 5)[ids].cpu()
        self.blocks_sent += len(request.block_ids)
        raw = blocks.view(torch.uint8).reshape(len(request.block_ids), -1).numpy()
        return reply, [memoryview(row) for row in raw]

    def _hand_off(self, frame: bytes) -> tuple[bytes, bool]:
        """The shared-memory hand-off's question: may this request have the cache's fd?"""
        try:
            request = self._handoff_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return msgspec.msgpack.encode(self._undecodable(str(e))), False
        reply = self._vet(request)
        if reply is None and (request.op != READ or request.transport != "shm"):
            reply = self._refuse(request, "the hand-off answers shared-memory reads only")
        if reply is None:
            with self._lock:
                reply = self._lookup(request)
        if reply is not None:
            return msgspec.msgpack.encode(reply), False
        return msgspec.msgpack.encode(KVReply(request.nonce, "ok", geometry=self.geometry)), True

    def _vet(self, request: KVRequest) -> KVReply | None:
        """The refusal of a request that is not this deployment's, not for this server, or
        malformed, before anything is looked up; None when it may go on."""
        problem = self.auth.check(request)
        if problem is None and request.engine_id != self.engine_id:
            problem = f"this is engine {self.engine_id}"
        if problem is None and request.op not in (READ, DONE):
            problem = f"unknown op {request.op!r}"
        if problem is None and request.transport not in TRANSPORTS:
            problem = f"unknown transport {request.transport!r}"
        if problem is None and request.op == READ:
            ids = request.block_ids
            if not ids:
                problem = "a read of no blocks"
            elif len(set(ids)) != len(ids):
                problem = "a block named twice"
            elif min(ids) < 0 or max(ids) >= self.num_blocks:
                problem = f"block ids outside the cache's {self.num_blocks}"
        return None if problem is None else self._refuse(request, problem)

    def _lookup(self, request: KVRequest) -> KVReply | None:
        """Under the lock: the answer for a request whose blocks are not (or no longer) its
        to read; None when they are."""
        exposed = self._exposed.get(request.request_id)
        if exposed is None:
            return KVReply(request.nonce, "unknown", "not exposed (yet, or any more)")
        if not hmac.compare_digest(request.secret.encode(), exposed.secret.encode()):
            return self._refuse(request, "wrong secret")
        if request.op == READ and not set(request.block_ids) <= set(exposed.block_ids):
            return self._refuse(request, "blocks outside the request's")
        return None

    def _count_error(self, what: str) -> None:
        """Count a refusal; warn of it unless another warning went out lately."""
        with self._errors_lock:
            self.protocol_errors += 1
            now = time.monotonic()
            if now < self._quiet_until:
                self._unlogged += 1
                return
            self._quiet_until, unlogged, self._unlogged = now + _LOG_EVERY, self._unlogged, 0
        log.warning("refused %s (and %d more since the last warning)", what, unlogged)

    def _undecodable(self, why: str) -> KVReply:
        self._count_error(f"an undecodable KV request: {why}")
        return KVReply(0, "refused", f"undecodable request: {why}")

    def _refuse(self, request: KVRequest, why: str) -> KVReply:
        self._count_error(f"a KV {request.op:.16} of {request.request_id:.64}: {why}")
        return KVReply(request.nonce, "refused", why)
