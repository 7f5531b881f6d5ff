"""The KV connector's transports, decode side: one rank's loader.

Loads run concurrently on a small pool of threads beside the step loop, each load with a ZMQ
DEALER of its own to the prefill rank's KV server (`transport.KVServer`), so one slow or dead
producer holds up only its own requests. Each load has a deadline counted from its submission,
not from when a thread takes it up, and stops early when its request is aborted (`cancel`);
either way it is reported failed, once its thread is through with the request's blocks, so the
scheduler frees them only when no rank still writes them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

import msgspec
import numpy as np
import torch
import zmq

from triode.wire.kv_transfer import DONE, READ, KVLoad, KVReply, KVRequest

from .shm import HandoffError, map_blocks, receive_cache
from .transport import RequestAuth, TransferError, block_bytes, geometry_of

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting load looks at its cancellation
_RETRY = (0.002, 0.05)  # a reader's first and longest pause before asking again
HANDOFF_TIMEOUT = 5.0  # seconds a shared-memory hand-off may take


class _Job:
    """A submitted load: what to copy, until when, and whether its request is still alive."""

    __slots__ = ("cancelled", "clock", "deadline", "load")

    def __init__(self, load: KVLoad, deadline: float, clock: Callable[[], float]) -> None:
        self.load = load
        self.deadline = deadline
        self.clock = clock
        self.cancelled = threading.Event()

    def remaining(self, timeout: float) -> float:
        """Seconds left; TransferError once cancelled or past the deadline."""
        if self.cancelled.is_set():
            raise TransferError("the request was aborted")
        left = self.deadline - self.clock()
        if left <= 0:
            raise TransferError(f"not loaded within {timeout}s of its submission")
        return left


class KVLoader:
    """Loads blocks from prefill ranks into this decode rank's cache, `workers` at a time."""

    def __init__(
        self,
        rank: int,
        cache: torch.Tensor,
        *,
        timeout: float,
        secret: bytes,
        workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` counts the loads' deadlines (seconds)."""
        self.rank = rank
        self.clock = clock
        self.cache = cache
        self.geometry = geometry_of(cache)
        self.timeout = timeout
        self.auth = RequestAuth(secret)
        self.protocol_errors = 0
        self.bytes_received = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._active: dict[str, _Job] = {}  # submitted, not yet reported
        self._ok: list[str] = []
        self._failed: list[str] = []
        self._lock = threading.Lock()
        self._nonces = itertools.count(1)
        self._context = zmq.Context()
        self._threads = [
            threading.Thread(target=self._run, name=f"kv-loader-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, load: KVLoad) -> None:
        """Queue a load; its deadline starts now."""
        job = _Job(load, self.clock() + self.timeout, self.clock)
        with self._lock:
            self._active[load.request_id] = job
        self._jobs.put(job)

    def cancel(self, request_ids: Iterable[str]) -> None:
        """Stop the loads of aborted requests: each is reported failed once its thread has let
        go of the blocks (at once when it had not started). Unknown ids are ignored."""
        with self._lock:
            for request_id in request_ids:
                job = self._active.get(request_id)
                if job is not None:
                    job.cancelled.set()

    @property
    def in_flight(self) -> int:
        """Loads submitted and not yet reported."""
        with self._lock:
            return len(self._active)

    def take(self) -> tuple[list[str], list[str]]:
        """(loaded, failed) since the last call."""
        with self._lock:
            ok, failed, self._ok, self._failed = self._ok, self._failed, [], []
        return ok, failed

    def close(self) -> None:
        with self._lock:
            for job in self._active.values():
                job.cancelled.set()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._context.term()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            request_id = job.load.request_id
            try:
                self._load(job)
            except TransferError as e:
                if e.protocol:
                    self._count(errors=1)
                log.warning(
                    "rank %d: loading the KV of %s failed (the prompt is recomputed): %s",
                    self.rank,
                    request_id,
                    e,
                )
                ok = False
            except Exception:
                log.exception("rank %d: loading the KV of %s failed", self.rank, request_id)
                ok = False
            else:
                ok = True
                log.debug(
                    "rank %d: loaded %d blocks of %s in %.1f ms",
                    self.rank,
                    len(job.load.block_ids),
                    request_id,
                    (time.perf_counter() - started) * 1e3,
                )
            with self._lock:
                if self._active.get(request_id) is job:
                    del self._active[request_id]
                (self._ok if ok else self._failed).append(request_id)

    def _count(self, *, errors: int = 0, received: int = 0) -> None:
        with self._lock:
            self.protocol_errors += errors
            self.bytes_received += received

    def _load(self, job: _Job) -> None:
        load = job.load
        if len(load.block_ids) != len(load.remote_block_ids):
            raise TransferError("as many local as remote blocks are needed")
        if not load.block_ids:
            return
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, len(load.block_ids) * block_bytes(self.geometry) + 65536)
        try:
            # connected first, so that a load past its deadline or aborted before it started
            # still tells the prefill DONE
            try:
                socket.connect(load.remote_endpoints[self.rank])
            except zmq.ZMQError as e:
                raise TransferError(f"cannot connect to the prefill rank: {e}") from e
            job.remaining(self.timeout)
            reply, payload = self._ask(socket, job, READ, load.remote_block_ids)
            self._copy_in(job, reply, payload)
            done, _ = self._ask(socket, job, DONE, retry=False)
            if done.status != "ok":
                raise TransferError(f"the blocks were withdrawn before DONE: {done.message}")
        except TransferError:
            # tell the prefill it can free them, if it still listens; never wait for it
            with contextlib.suppress(zmq.ZMQError):
                socket.setsockopt(zmq.LINGER, 200)
                request = self.auth.sign(self._request(load, DONE))
                socket.send(msgspec.msgpack.encode(request), zmq.NOBLOCK)
            raise
        finally:
            socket.close()

    def _request(self, load: KVLoad, op: str, block_ids: list[int] | None = None) -> KVRequest:
        return KVRequest(
            op=op,
            nonce=next(self._nonces),
            engine_id=load.remote_engine_id,
            request_id=load.remote_request_id,
            secret=load.secret,
            block_ids=block_ids or [],
            transport=load.transport,
        )

    def _ask(
        self,
        socket: zmq.Socket,
        job: _Job,
        op: str,
        block_ids: list[int] | None = None,
        *,
        retry: bool = True,
    ) -> tuple[KVReply, list[zmq.Frame]]:
        """Send a request until an "ok" answer; "unknown" is asked again (a prefill exposes its
        blocks a step after it finished) until the job's deadline."""
        pause = _RETRY[0]
        while True:
            request = self.auth.sign(self._request(job.load, op, block_ids))
            socket.send(msgspec.msgpack.encode(request))
            while True:  # skip late replies to earlier attempts
                if not socket.poll(int(min(job.remaining(self.timeout), _POLL_S) * 1000) + 1):
                    continue
                header, *payload = socket.recv_multipart(copy=False)
                try:
                    reply = msgspec.msgpack.decode(header.buffer, type=KVReply)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise TransferError(f"undecodable reply: {e}", protocol=True) from e
                if reply.nonce == request.nonce:
                    break
            if reply.status == "ok" or not retry:
                return reply, payload
            if reply.status != "unknown":
                raise TransferError(f"the prefill rank refused: {reply.message}")
            job.cancelled.wait(min(pause, job.remaining(self.timeout)))
            pause = min(pause * 2, _RETRY[1])

    def _copy_in(self, job: _Job, reply: KVReply, payload: list[zmq.Frame]) -> None:
        load = job.load
        if reply.geometry != self.geometry:
            raise TransferError(
                f"the prefill rank's KV geometry {reply.geometry} is not this one's "
                f"{self.geometry}",
                protocol=True,
            )
        dst = torch.tensor(load.block_ids, dtype=torch.int64, device=self.cache.device)
        if load.transport == "shm":
            if payload:
                raise TransferError("a shared-memory reply with block frames", protocol=True)
            src = self._handed_blocks(job, reply)
        else:
            size = block_bytes(self.geometry)
            if len(payload) != len(load.block_ids) or any(len(f.buffer) != size for f in payload):
                raise TransferError(
                    f"{len(payload)} block frames of {[len(f.buffer) for f in payload[:4]]} "
                    f"bytes, not {len(load.block_ids)} of {size}",
                    protocol=True,
                )
            blocks = torch.empty((len(payload), *self.geometry.block_shape), dtype=self.cache.dtype)
            staging = blocks.view(torch.uint8).view(len(payload), size).numpy()
            for row, frame in zip(staging, payload, strict=True):
                row[:] = np.frombuffer(frame.buffer, dtype=np.uint8)
            src = blocks.permute(1, 2, 0, 3, 4, 5)
        job.remaining(self.timeout)  # an aborted request's blocks are left as they are
        self.cache.index_copy_(2, dst, src.to(self.cache.device))
        self._count(received=len(load.block_ids) * block_bytes(self.geometry))

    def _handed_blocks(self, job: _Job, reply: KVReply) -> torch.Tensor:
        """The load's remote blocks, out of the cache the producer's hand-off gives an
        authenticated reader: only memory it hands over, only the blocks this load names."""
        ref, g, ids = reply.shm, self.geometry, job.load.remote_block_ids
        if ref is None or not ref.path or not 0 < ref.num_blocks <= 1 << 31:
            raise TransferError("a shared-memory reply names no cache", protocol=True)
        size = ref.num_blocks * block_bytes(g)
        if ref.size != size:
            raise TransferError(f"a cache of {ref.size} bytes, not {size}", protocol=True)
        if min(ids) < 0 or max(ids) >= ref.num_blocks:
            raise TransferError("block ids outside the prefill's cache", protocol=True)
        request = self.auth.sign(self._request(job.load, READ, ids))
        # bounded apart from the load's deadline: the hand-off answers at once or not at all
        deadline = time.monotonic() + min(job.remaining(self.timeout), HANDOFF_TIMEOUT)
        try:
            answer, fd = receive_cache(ref.path, msgspec.msgpack.encode(request), size, deadline)
        except HandoffError as e:
            raise TransferError(str(e), protocol=e.protocol) from e
        try:
            try:
                handed = msgspec.msgpack.decode(answer, type=KVReply)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise TransferError(f"undecodable hand-off reply: {e}", protocol=True) from e
            if fd is None or handed.status != "ok" or handed.geometry != g:
                raise TransferError(f"the hand-off refused: {handed.status} {handed.message}")
            shape = (g.num_layers, 2, ref.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
            return map_blocks(fd, shape, self.cache.dtype, ids)
        finally:
            if fd is not None:
                os.close(fd)
