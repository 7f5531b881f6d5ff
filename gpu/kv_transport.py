"""The KV connector's transports: one rank's KV server (prefill side) and loader (decode side).

Both run on threads of their own beside the step loop, each with its own ZMQ socket, so no
transfer ever blocks a step. Messages are `triode.wire.kv_transfer`'s: a decode rank's DEALER
sends a `KVRequest`, the prefill rank's ROUTER answers with a `KVReply`.

- **tcp**: the reply to READ carries the blocks, one frame per block (every layer's K and V,
  block-major), sent zero-copy from a gathered copy of the cache.
- **shm**: the prefill rank's whole cache lives in a memfd; the reply to READ names it
  (`/proc/<pid>/fd/<fd>`, same host and user only) and the reader copies the blocks straight
  out of a private (copy-on-write) mapping. The prefill's memory goes when its process does.

Consistency: a request's blocks are readable only while exposed. DONE ends that (the reader is
through) and is acknowledged only if the blocks were still exposed, and the scheduler frees
blocks only after DONE or after withdrawing them (`release`, applied before the forward that
could reuse them). So a reader that gets its DONE acknowledged read blocks nobody had
overwritten; one that does not discards what it read.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable

import msgspec
import numpy as np
import torch
import zmq

from triode.wire.kv_transfer import (
    DONE,
    READ,
    KVExpose,
    KVGeometry,
    KVLoad,
    KVReply,
    KVRequest,
    KVShmRef,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a KVRequest names block ids, a reply's header is small: anything larger is hostile
MAX_REQUEST_BYTES = 1 << 20
_POLL_MS = 50  # how often the threads look at their stop flag
_RETRY = (0.002, 0.05)  # a reader's first and longest pause before asking again


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


def shared_cache(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A zeroed CPU tensor in a fresh memfd, and the fd, which the process keeps open."""
    numel = 1
    for n in shape:
        numel *= n
    fd = os.memfd_create("triode-kv-cache", os.MFD_CLOEXEC)
    os.ftruncate(fd, numel * dtype.itemsize)
    tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    return tensor.view(shape), fd


class KVServer:
    """Serves one prefill rank's exposed blocks to the decode ranks that ask."""

    def __init__(
        self,
        bind: str,
        cache: torch.Tensor,
        *,
        engine_id: str,
        shm_fd: int | None = None,
    ) -> None:
        self.cache = cache
        self.geometry = geometry_of(cache)
        self.engine_id = engine_id
        self.shm = None if shm_fd is None else KVShmRef(os.getpid(), shm_fd, cache.shape[2])
        self.protocol_errors = 0
        self.blocks_sent = 0
        self._exposed: dict[str, KVExpose] = {}
        self._done: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(KVRequest)
        self._encoder = msgspec.msgpack.Encoder()
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

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            identity, *frames = self._socket.recv_multipart(copy=False)
            header, payload = self._answer(frames)
            self._socket.send_multipart(
                [identity, self._encoder.encode(header), *payload], copy=False
            )

    def _answer(self, frames: list[zmq.Frame]) -> tuple[KVReply, list[memoryview]]:
        try:
            if len(frames) != 1:
                raise msgspec.ValidationError(f"{len(frames)} frames, not 1")
            request = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.protocol_errors += 1
            log.warning("refused an undecodable KV request: %s", e)
            return KVReply(0, "refused", f"undecodable request: {e}"), []
        if request.engine_id != self.engine_id:
            return self._refuse(request, f"this is engine {self.engine_id}"), []
        with self._lock:
            exposed = self._exposed.get(request.request_id)
            if exposed is None:
                return KVReply(request.nonce, "unknown", "not exposed (yet, or any more)"), []
            if not hmac.compare_digest(request.secret.encode(), exposed.secret.encode()):
                return self._refuse(request, "wrong secret"), []
            if request.op == DONE:
                del self._exposed[request.request_id]
                self._done.append(request.request_id)
                return KVReply(request.nonce, "ok"), []
            if request.op != READ:
                self.protocol_errors += 1
                return self._refuse(request, f"unknown op {request.op!r}"), []
            if not set(request.block_ids) <= set(exposed.block_ids):
                return self._refuse(request, "blocks outside the request's"), []
            reply = KVReply(request.nonce, "ok", geometry=self.geometry)
            if request.transport == "shm":
                if self.shm is None:
                    return self._refuse(request, "this server's cache is not in shared memory"), []
                reply.shm = self.shm
                return reply, []
            if request.transport != "tcp":
                return self._refuse(request, f"unknown transport {request.transport!r}"), []
            # one copy, block-major, made before the lock lets a release (and reuse) through
            ids = torch.tensor(request.block_ids, dtype=torch.int64, device=self.cache.device)
            blocks = self.cache.permute(2, 0, 1, 3, 4, 5)[ids].cpu()
        self.blocks_sent += len(request.block_ids)
        raw = blocks.view(torch.uint8).reshape(len(request.block_ids), -1).numpy()
        return reply, [memoryview(row) for row in raw]

    def _refuse(self, request: KVRequest, why: str) -> KVReply:
        log.warning("refused a KV %s of %s: %s", request.op, request.request_id, why)
        return KVReply(request.nonce, "refused", why)


class KVLoader:
    """Loads blocks from prefill ranks into this decode rank's cache, one request at a time."""

    def __init__(self, rank: int, cache: torch.Tensor, *, timeout: float) -> None:
        self.rank = rank
        self.cache = cache
        self.geometry = geometry_of(cache)
        self.timeout = timeout
        self.protocol_errors = 0
        self.bytes_received = 0
        self._jobs: queue.SimpleQueue[KVLoad | None] = queue.SimpleQueue()
        self._ok: list[str] = []
        self._failed: list[str] = []
        self._lock = threading.Lock()
        self._nonces = itertools.count(1)
        self._context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KVReply)
        self._thread = threading.Thread(target=self._run, name="kv-loader", daemon=True)
        self._thread.start()

    def submit(self, load: KVLoad) -> None:
        self._jobs.put(load)

    def take(self) -> tuple[list[str], list[str]]:
        """(loaded, failed) since the last call."""
        with self._lock:
            ok, failed, self._ok, self._failed = self._ok, self._failed, [], []
        return ok, failed

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._context.term()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                self._load(job)
            except TransferError as e:
                if e.protocol:
                    self.protocol_errors += 1
                log.warning(
                    "rank %d: loading the KV of %s failed (the prompt is recomputed): %s",
                    self.rank,
                    job.request_id,
                    e,
                )
                outcome = self._failed
            except Exception:
                log.exception("rank %d: loading the KV of %s failed", self.rank, job.request_id)
                outcome = self._failed
            else:
                outcome = self._ok
                log.debug(
                    "rank %d: loaded %d blocks of %s in %.1f ms",
                    self.rank,
                    len(job.block_ids),
                    job.request_id,
                    (time.perf_counter() - started) * 1e3,
                )
            with self._lock:
                outcome.append(job.request_id)

    def _load(self, job: KVLoad) -> None:
        if len(job.block_ids) != len(job.remote_block_ids):
            raise TransferError("as many local as remote blocks are needed")
        if not job.block_ids:
            return
        deadline = time.monotonic() + self.timeout
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, len(job.block_ids) * block_bytes(self.geometry) + 65536)
        try:
            socket.connect(job.remote_endpoints[self.rank])
            read = self._request(job, READ, job.remote_block_ids)
            reply, payload = self._ask(socket, read, deadline)
            self._copy_in(job, reply, payload)
            done, _ = self._ask(socket, self._request(job, DONE), deadline, retry=False)
            if done.status != "ok":
                raise TransferError(f"the blocks were withdrawn before DONE: {done.message}")
        except TransferError:
            # tell the prefill it can free them, if it still listens; never wait for it
            with contextlib.suppress(zmq.ZMQError):
                socket.setsockopt(zmq.LINGER, 200)
                socket.send(self._encoder.encode(self._request(job, DONE)), zmq.NOBLOCK)
            raise
        finally:
            socket.close()

    def _request(self, job: KVLoad, op: str, block_ids: list[int] | None = None) -> KVRequest:
        return KVRequest(
            op=op,
            nonce=next(self._nonces),
            engine_id=job.remote_engine_id,
            request_id=job.remote_request_id,
            secret=job.secret,
            block_ids=block_ids or [],
            transport=job.transport,
        )

    def _ask(
        self, socket: zmq.Socket, request: KVRequest, deadline: float, *, retry: bool = True
    ) -> tuple[KVReply, list[zmq.Frame]]:
        """Send `request` until an "ok" answer; "unknown" is asked again (a prefill exposes its
        blocks a step after it finished) until `deadline`."""
        pause = _RETRY[0]
        while True:
            socket.send(self._encoder.encode(request))
            while True:  # skip late replies to earlier attempts
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not socket.poll(int(remaining * 1000) + 1):
                    raise TransferError(f"no answer from the prefill rank within {self.timeout}s")
                header, *payload = socket.recv_multipart(copy=False)
                try:
                    reply = self._decoder.decode(header.buffer)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise TransferError(f"undecodable reply: {e}", protocol=True) from e
                if reply.nonce == request.nonce:
                    break
            if reply.status == "ok" or not retry:
                return reply, payload
            if reply.status != "unknown":
                raise TransferError(f"the prefill rank refused: {reply.message}")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _RETRY[1])
            request.nonce = next(self._nonces)

    def _copy_in(self, job: KVLoad, reply: KVReply, payload: list[zmq.Frame]) -> None:
        if reply.geometry != self.geometry:
            raise TransferError(
                f"the prefill rank's KV geometry {reply.geometry} is not this one's "
                f"{self.geometry}",
                protocol=True,
            )
        dst = torch.tensor(job.block_ids, dtype=torch.int64, device=self.cache.device)
        if job.transport == "shm":
            if payload or reply.shm is None:
                raise TransferError("a shared-memory reply names no cache", protocol=True)
            src = self._shared_blocks(reply.shm, job.remote_block_ids)
        else:
            size = block_bytes(self.geometry)
            if len(payload) != len(job.block_ids) or any(len(f.buffer) != size for f in payload):
                raise TransferError(
                    f"{len(payload)} block frames of {[len(f.buffer) for f in payload[:4]]} "
                    f"bytes, not {len(job.block_ids)} of {size}",
                    protocol=True,
                )
            blocks = torch.empty((len(payload), *self.geometry.block_shape), dtype=self.cache.dtype)
            staging = blocks.view(torch.uint8).view(len(payload), size).numpy()
            for row, frame in zip(staging, payload, strict=True):
                row[:] = np.frombuffer(frame.buffer, dtype=np.uint8)
            src = blocks.permute(1, 2, 0, 3, 4, 5)
        self.cache.index_copy_(2, dst, src.to(self.cache.device))
        self.bytes_received += len(job.block_ids) * block_bytes(self.geometry)

    def _shared_blocks(self, ref: KVShmRef, block_ids: list[int]) -> torch.Tensor:
        """The blocks, gathered out of a private mapping of the prefill rank's cache."""
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        g = self.geometry
        shape = (g.num_layers, 2, ref.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * shape[5]
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise TransferError(f"cannot reach the prefill's cache at {path}: {e}") from e
        if size != numel * self.cache.dtype.itemsize:
            raise TransferError(f"{path} has {size} bytes, not a cache of {shape}", protocol=True)
        if max(block_ids) >= ref.num_blocks or min(block_ids) < 0:
            raise TransferError("block ids outside the prefill's cache", protocol=True)
        remote = torch.from_file(path, shared=False, size=numel, dtype=self.cache.dtype)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return remote.view(shape).index_select(2, ids)
