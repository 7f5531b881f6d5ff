"""The trainer's side of weight transfer: `WeightSyncClient` drives a server's four calls
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` once per bucket,
`/finish_weight_update`) and moves the tensors, through shared memory (`shm`, a trainer on the
server's host) or as broadcasts of a torch.distributed group it hosts (`broadcast`).

    with WeightSyncClient("http://127.0.0.1:8000", api_key=key, backend="shm") as client:
        version = client.update(model.named_parameters())

Tensors go in buckets of at most `bucket_bytes` (a tensor larger than that alone), so the
trainer's extra memory is one bucket. Every segment the client made is unlinked once its call is
answered, however it went, and on `close` (and at exit, for a client nobody closed).
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import msgspec
import torch

from triode.wire.ports import free_port
from triode.wire.shm_segment import unlink_untracked
from triode.wire.weight_update import ALIGN, BACKENDS, MAX_TIMEOUT, TRANSPORTS

from .broadcast import Abandoned, Rendezvous, TrainerGroup
from .shm import dtype_name, write_bucket

DEFAULT_BUCKET_BYTES = 256 << 20
_HTTP_MARGIN = 30.0  # seconds an HTTP call may take beyond the group's timeout

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(Exception):
    """The server refused a call (`status` is its HTTP status, `type` and `code` its error's),
    could not be reached (`status` None), or the tensors could not be moved."""

    def __init__(
        self, message: str, *, status: int | None = None, type: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.message = message
        self.status = status
        self.type = type
        self.code = code


class WeightSyncClient:
    """New weights for the server at `url` (`api_key`: its bearer token).

    `backend`: "shm" or "broadcast". For the broadcast the client hosts the group's store at
    `master_address`:`master_port` (None: a free port) and is its rank 0; `transport` is "gloo"
    (CPU tensors) or "nccl" (CUDA), None taking nccl where this process has CUDA. `timeout`
    bounds the group's joining and each broadcast, in seconds; an HTTP call may take 30 s more.
    Blocking, for one thread at a time."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        backend: str = "shm",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        transport: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        if bucket_bytes < 1:
            raise ValueError("bucket_bytes must be at least 1")
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)} or None")
        if not 0 < timeout <= MAX_TIMEOUT:
            raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT}] seconds")
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self._master_address = master_address
        self._master_port = master_port
        self._transport = transport or ("nccl" if torch.cuda.is_available() else "gloo")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout + _HTTP_MARGIN
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-sync")
        self._group: TrainerGroup | None = None
        self._segments: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)

    def __enter__(self) -> WeightSyncClient:
        try:
            self.init()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def init(self) -> None:
        """`/init_weight_transfer_engine`; for the broadcast, the group forms (every engine
        rank of the server joins it) before this returns. Raises WeightSyncError."""
        if self.backend == "shm":
            self._call("/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
            return
        self._close_group()
        engines = self._call("/get_world_size", None).get("world_size")
        if not isinstance(engines, int) or isinstance(engines, bool) or engines < 1:
            raise WeightSyncError(f"/get_world_size answered world_size {engines!r}")
        world = 1 + engines
        port = self._master_port or free_port(self._master_address)
        init_info = {
            "backend": "broadcast",
            "master_address": self._master_address,
            "master_port": port,
            "world_size": world,
            "transport": self._transport,
            "timeout": self.timeout,
        }
        try:
            rendezvous = Rendezvous(
                self._master_address,
                port,
                world,
                transport=self._transport,
                timeout=self.timeout,
            )
        except (RuntimeError, OSError) as e:
            raise WeightSyncError(f"cannot listen at {self._master_address}:{port}: {e}") from e
        try:
            answer = self._pool.submit(
                self._call, "/init_weight_transfer_engine", {"init_info": init_info}
            )
            try:
                group = rendezvous.join(abandoned=lambda: _failed(answer))
            except Exception as e:
                if _failed(answer):
                    answer.result()  # raises the server's refusal, which made the trainer stop
                raise WeightSyncError(f"the group at {self._master_address}:{port}: {e}") from e
        finally:
            rendezvous.close()  # a traceback holding this frame must not keep the store
        try:
            answer.result()
        except BaseException:
            group.close()
            raise
        self._group = group

    def update(self, named_tensors: NamedTensors) -> int:
        """`start`, `send`, `finish`: the server's new weight version. Raises WeightSyncError
        (or ValueError for a tensor of a dtype the wire cannot name) and leaves the update
        started: `send` again, or `finish` to serve with the buckets that were loaded."""
        self.start()
        self.send(named_tensors)
        return self.finish()

    def start(self) -> None:
        """`/start_weight_update`. Raises WeightSyncError."""
        self._call("/start_weight_update", {})

    def send(self, named_tensors: NamedTensors) -> None:
        """One `/update_weights` per bucket of `named_tensors` ((name, tensor) pairs as a
        model's `named_parameters()` gives them, on any device), in order. Raises
        WeightSyncError at the first bucket that fails, ValueError for a tensor of a dtype the
        wire cannot name; the buckets before it are loaded."""
        for bucket in buckets(named_tensors, self.bucket_bytes):
            if self.backend == "shm":
                self._send_shm(bucket)
            else:
                self._send_broadcast(bucket)

    def finish(self) -> int:
        """`/finish_weight_update`: the server's new weight version. Raises WeightSyncError."""
        version = self._call("/finish_weight_update", {}).get("weight_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightSyncError(f"/finish_weight_update answered weight_version {version!r}")
        return version

    def close(self) -> None:
        """Close the group and unlink every segment still held. Idempotent."""
        self._close_group()
        _unlink_all(self._segments)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _send_shm(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        written = write_bucket(bucket)
        self._segments.add(written.shm_name)
        try:
            info = {"buckets": [msgspec.to_builtins(written)]}
            self._call("/update_weights", {"update_info": info})
        finally:
            unlink_untracked(written.shm_name)
            self._segments.discard(written.shm_name)

    def _send_broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self._group is None:
            self.init()  # a failed broadcast closed the last group
        group = self._group
        assert group is not None
        info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [dtype_name(t) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
        answer = self._pool.submit(self._call, "/update_weights", {"update_info": info})
        try:
            group.send([t for _, t in bucket], abandoned=lambda: _failed(answer))
        except Abandoned:
            self._close_group()
            answer.result()  # raises the server's refusal
            raise
        except Exception as e:
            self._close_group()
            try:
                answer.result()
            except WeightSyncError as refused:
                raise refused from e
            raise WeightSyncError(f"the broadcast failed: {e}") from e
        except BaseException:
            self._close_group()
            raise
        answer.result()

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def _call(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            if body is None:
                response = self._http.get(path)
            else:
                response = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{path}: {e}") from e
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.is_success:
            if not isinstance(answer, dict):
                raise WeightSyncError(f"{path} answered {response.text[:200]!r}, not an object")
            return answer
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict):
            raise WeightSyncError(
                f"{path}: {error.get('message')}",
                status=response.status_code,
                type=error.get("type"),
                code=error.get("code"),
            )
        raise WeightSyncError(f"{path}: {response.text[:200]}", status=response.status_code)


def buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """`named_tensors` in order, cut into buckets of at most `bucket_bytes` as packed at
    `ALIGN`-byte offsets; a tensor larger than that makes a bucket of its own."""
    bucket: list[tuple[str, Any]] = []
    used = 0
    for name, tensor in named_tensors:
        size = -(-(tensor.numel() * tensor.element_size()) // ALIGN) * ALIGN
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


def _failed(future: concurrent.futures.Future[Any]) -> bool:
    return future.done() and future.exception() is not None


def _unlink_all(names: set[str]) -> None:
    for name in list(names):
        unlink_untracked(name)
        names.discard(name)
