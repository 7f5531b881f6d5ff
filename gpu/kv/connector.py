"""The KV connector's worker side: one per rank, beside the model runner.

After vLLM V1's `KVConnectorBase_V1` in its worker role. `register_kv_caches` takes the rank's
cache and starts its KV server (prefill side, `transport.py`) and loader (decode side,
`loader.py`), both keyed with the deployment's secret;
around each forward the runner binds the step's `KVConnectorMetadata` (exposing and
withdrawing blocks, then `start_load_kv`), and when the metadata asks, every rank's
`get_finished` goes to the driver, which reports a transfer once every rank is through with it
(`FinishedTransfers`).

This connector pulls: a decode rank copies whole blocks into blocks its scheduler keeps out of
every step until the copy is done, and a prefill rank's blocks stay where its forward wrote
them. So `wait_for_layer_load`, `save_kv_layer` and `wait_for_save` have nothing to wait for or
send; a push transport (NCCL send/recv, RDMA writes) would do its work there.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import msgspec
import torch

from triode.wire.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVTransferConfig

from .loader import KVLoader
from .shm import shared_cache
from .transport import KVServer

# threads loading at once on a rank: up to the admitted loads, at most this many
MAX_LOADER_THREADS = 8


class KVConnectorWorker:
    """One rank's connector. `allocate` makes the rank's cache (in a memfd for the shared-memory
    transport), `register_kv_caches` puts it to use."""

    def __init__(self, config: dict[str, Any] | KVTransferConfig, rank: int) -> None:
        self.config = (
            msgspec.convert(config, KVTransferConfig) if isinstance(config, dict) else config
        )
        self.rank = rank
        # read at once, so that a rank with an unusable secret file fails before it serves
        self._secret = self.config.read_secret()
        self.server: KVServer | None = None
        self.loader: KVLoader | None = None
        self._shm_fd: int | None = None
        self._metadata: KVConnectorMetadata | None = None
        self._reported_errors = 0
        self._reported_bytes = 0

    @property
    def endpoint(self) -> str | None:
        """This rank's KV server (`tcp://host:port`), on a prefill instance."""
        return self.server.endpoint if self.server is not None else None

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zeroed cache of `shape`; shared with readers on this host where the transport is
        shared memory."""
        if self.config.is_producer and self.config.transport == "shm":
            if device.type != "cpu":
                raise ValueError("the shm KV transport serves a CPU cache; use tcp on CUDA")
            cache, self._shm_fd = shared_cache(shape, dtype)
            return cache
        return torch.zeros(shape, dtype=dtype, device=device)

    def register_kv_caches(self, cache: torch.Tensor) -> None:
        config = self.config
        if config.is_producer:
            host = f"[{config.kv_ip}]" if ":" in config.kv_ip else config.kv_ip
            port = config.kv_port + self.rank if config.kv_port else "*"
            assert config.engine_id is not None
            self.server = KVServer(
                f"tcp://{host}:{port}",
                cache,
                engine_id=config.engine_id,
                secret=self._secret,
                shm_fd=self._shm_fd,
            )
        if config.is_consumer:
            self.loader = KVLoader(
                self.rank,
                cache,
                timeout=config.load_timeout,
                secret=self._secret,
                workers=min(config.max_concurrent_loads, MAX_LOADER_THREADS),
            )

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Take a step's metadata before its forward: withdrawn blocks stop being served
        before anything can overwrite them, new ones become readable."""
        self._metadata = metadata
        if self.server is not None:
            self.server.release(metadata.release)
            self.server.expose(metadata.expose)

    def start_load_kv(self) -> None:
        """Start the bound metadata's loads, and stop those of aborted requests; they run
        beside the steps."""
        if self._metadata is None or self.loader is None:
            return
        for load in self._metadata.loads:
            self.loader.submit(load)
        self.loader.cancel(self._metadata.cancel)

    def wait_for_layer_load(self, layer: int) -> None:
        """Nothing to wait for: a loading request is in no step until its blocks are whole."""

    def save_kv_layer(self, layer: int, kv: torch.Tensor) -> None:
        """Nothing to send: the blocks stay in this rank's cache until the decode reads them."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see `save_kv_layer`)."""

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def get_finished(self) -> KVConnectorOutput:
        """This rank's transfers finished since the last call, and its counters' growth."""
        report = KVConnectorOutput()
        errors = received = 0
        if self.server is not None:
            report.finished_sending = self.server.take_done()
            errors += self.server.protocol_errors
        if self.loader is not None:
            report.finished_recving, report.failed_recving = self.loader.take()
            errors += self.loader.protocol_errors
            received = self.loader.bytes_received
        report.protocol_errors, self._reported_errors = errors - self._reported_errors, errors
        report.bytes_received, self._reported_bytes = received - self._reported_bytes, received
        return report

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.loader is not None:
            self.loader.close()
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None


class FinishedTransfers:
    """The driver's tally: a transfer is finished once every rank of the world reported it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        self._failed: set[str] = set()

    def add(self, reports: list[KVConnectorOutput]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for report in reports:
            self._sending.update(report.finished_sending)
            self._recving.update(report.finished_recving)
            self._recving.update(report.failed_recving)
            self._failed.update(report.failed_recving)
            out.protocol_errors += report.protocol_errors
            out.bytes_received += report.bytes_received
        for request_id in [r for r, n in self._sending.items() if n >= self.world_size]:
            del self._sending[request_id]
            out.finished_sending.append(request_id)
        for request_id in [r for r, n in self._recving.items() if n >= self.world_size]:
            del self._recving[request_id]
            if request_id in self._failed:
                self._failed.discard(request_id)
                out.failed_recving.append(request_id)
            else:
                out.finished_recving.append(request_id)
        return out

    def forget(self, request_ids: list[str]) -> None:
        """Withdrawn holds: DONEs still missing from some rank will never be needed."""
        for request_id in request_ids:
            self._sending.pop(request_id, None)
