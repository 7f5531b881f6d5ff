"""The KV connector's messages: what the scheduler tells the workers about transfers, what they
report back, and the transfer protocol between a decode instance's ranks and a prefill's.

Disaggregated prefill, pulled by the decode side: the prefill instance keeps a finished
request's blocks and *exposes* them on each rank's KV server; the decode instance's rank r asks
the prefill's rank r for them (`KVRequest` READ), copies them into its own blocks, and says DONE,
after which the prefill frees them. With the TCP transport the blocks travel in the reply as one
frame each; with shared memory the reply names the unix socket where the prefill rank hands an
authenticated reader on the same host its cache (a memfd, over SCM_RIGHTS), and the reader
copies straight out of it. Every `KVRequest` is signed with the deployment's secret.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from .json_config import parse_config
from .kv_seal import SECRET_RECIPE, read_secret
from .messages import _HOT

# what a KVRequest's `op` may be
READ = "read"
DONE = "done"
TRANSPORTS = ("tcp", "shm")
CONNECTORS = ("TriodeConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
EXTRA_DEFAULTS: dict[str, Any] = {
    "transport": "tcp",  # tcp (ZMQ, any host) | shm (the producer's cache in shared memory)
    "load_timeout": 30.0,  # seconds a decode rank tries to read a request's blocks
    "hold_timeout": 120.0,  # seconds a prefill keeps blocks nobody said DONE for
    "secret_file": None,  # the deployment's shared secret (`kv_seal.read_secret`): required
    "max_hold_fraction": 0.5,  # of a prefill's cache that blocks kept for decodes may take
    "max_concurrent_loads": 16,  # a decode's loads admitted at once; past it a 429
    # whose unsealed do_remote_decode a prefill seals itself, so that it holds blocks:
    # "never" (only the deployment's proxy may ask), or "authenticated" (a request that
    # passed the server's --api-key check, e.g. vllm-router's prefill leg)
    "unsealed_holds": "never",
}
UNSEALED_HOLDS = ("never", "authenticated")


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`--kv-transfer-config`, in vLLM's spelling. `kv_port` 0 binds each rank's KV server on
    any free port; otherwise rank r binds `kv_port + r`. `kv_connector_extra_config` takes
    `transport`, `load_timeout`, `hold_timeout`, `max_hold_fraction`, `max_concurrent_loads`,
    `unsealed_holds` and `secret_file`, which every instance needs: the instances of a
    deployment share its secret, which seals the params they hand on and signs their KV
    requests (see `EXTRA_DEFAULTS` and `triode.wire.kv_seal`)."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_connector must be one of {', '.join(CONNECTORS)}, not {self.kv_connector!r}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, not {self.kv_role!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError("kv_port must be a TCP port, or 0 for any free one")
        if self.engine_id is None:
            self.engine_id = uuid.uuid4().hex
        unknown = set(self.kv_connector_extra_config) - set(EXTRA_DEFAULTS)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {sorted(unknown)}; "
                f"known: {', '.join(EXTRA_DEFAULTS)}"
            )
        self.kv_connector_extra_config = {**EXTRA_DEFAULTS, **self.kv_connector_extra_config}
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        for name in ("load_timeout", "hold_timeout"):
            value = self.kv_connector_extra_config[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"kv_connector_extra_config: {name} must be a number > 0")
        fraction = self.kv_connector_extra_config["max_hold_fraction"]
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise ValueError("kv_connector_extra_config: max_hold_fraction must be in (0, 1]")
        secret_file = self.kv_connector_extra_config["secret_file"]
        if not isinstance(secret_file, str) or not secret_file:
            raise ValueError(
                "kv_connector_extra_config: secret_file is required: the instances of a "
                f"deployment share a secret; make one with: {SECRET_RECIPE}"
            )
        if self.kv_connector_extra_config["unsealed_holds"] not in UNSEALED_HOLDS:
            raise ValueError(
                "kv_connector_extra_config: unsealed_holds must be one of "
                + ", ".join(UNSEALED_HOLDS)
            )
        loads = self.kv_connector_extra_config["max_concurrent_loads"]
        if isinstance(loads, bool) or not isinstance(loads, int) or not 1 <= loads <= 4096:
            raise ValueError("kv_connector_extra_config: max_concurrent_loads must be 1 to 4096")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transport(self) -> str:
        return str(self.kv_connector_extra_config["transport"])

    @property
    def load_timeout(self) -> float:
        return float(self.kv_connector_extra_config["load_timeout"])

    @property
    def hold_timeout(self) -> float:
        return float(self.kv_connector_extra_config["hold_timeout"])

    @property
    def max_hold_fraction(self) -> float:
        return float(self.kv_connector_extra_config["max_hold_fraction"])

    @property
    def secret_file(self) -> str:
        return str(self.kv_connector_extra_config["secret_file"])

    def read_secret(self) -> bytes:
        """The deployment's secret; `kv_seal.SecretFileError` (a ValueError, one line) when
        the file cannot serve as one."""
        return read_secret(self.secret_file)

    @property
    def unsealed_holds(self) -> str:
        return str(self.kv_connector_extra_config["unsealed_holds"])

    @property
    def max_concurrent_loads(self) -> int:
        return int(self.kv_connector_extra_config["max_concurrent_loads"])


def parse_kv_transfer_config(value: str | dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
    """A config from its JSON text (the CLI's), a dict, or itself; ValueError when invalid."""
    return parse_config(value, KVTransferConfig, "kv_transfer_config")


class KVExpose(msgspec.Struct, **_HOT):
    """A finished prefill's blocks, from now on readable by whoever knows `secret`."""

    request_id: str
    block_ids: list[int]
    secret: str


class KVLoad(msgspec.Struct, **_HOT):
    """Copy a prefill instance's blocks `remote_block_ids` into this instance's `block_ids`.

    `remote_endpoints[r]` is the KV server of the prefill's rank r (`tcp://host:port`); rank r
    here reads from it. Both worlds have the same tensor x pipeline layout, so the shards match.
    """

    request_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    remote_request_id: str
    remote_engine_id: str
    remote_endpoints: list[str]
    secret: str
    transport: str = "tcp"


class KVConnectorMetadata(msgspec.Struct, **_HOT):
    """The scheduler's word to the workers' connectors, with a step.

    `release` names exposed requests whose blocks the scheduler freed (after their DONE, or
    when the hold timed out): the servers stop serving them before this step's forward runs,
    so a read never sees a block after its reuse. `sync` asks every rank to report its
    finished transfers (`KVConnectorOutput`) with this step's result; it is set whenever any
    transfer is outstanding, identically for every rank, because the report is a collective.
    """

    expose: list[KVExpose] = []
    release: list[str] = []
    loads: list[KVLoad] = []
    sync: bool = False
    cancel: list[str] = []  # loads whose request was aborted: stopped, reported as failed


class KVConnectorOutput(msgspec.Struct, **_HOT):
    """Transfers that every rank has finished since the last report.

    A load is `finished_recving` when every rank copied its shard, `failed_recving` when every
    rank is through with it and any failed (the scheduler then recomputes the prompt).
    `finished_sending`: every rank's reader said DONE. Counters are the world's totals.
    """

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    failed_recving: list[str] = []
    protocol_errors: int = 0
    bytes_received: int = 0


class KVGeometry(msgspec.Struct, **_HOT):
    """One rank's KV cache: [layers, 2, blocks, block_size, kv_heads, head_dim] of `dtype`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block across every layer, K and V: what one TCP frame carries."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


class KVRequest(msgspec.Struct, **_HOT, forbid_unknown_fields=True):
    """A decode rank's message to a prefill rank's KV server (one msgpack frame)."""

    op: str  # READ or DONE
    nonce: int  # echoed in the reply, so a late reply to an earlier attempt is recognised
    engine_id: str
    request_id: str
    secret: str
    block_ids: list[int] = []
    transport: str = "tcp"
    timestamp: float = 0.0  # the sender's wall clock: a request is good within a window of it
    mac: bytes = b""  # HMAC-SHA256 of the request with `mac` empty, keyed from the deployment's


class KVShmRef(msgspec.Struct, **_HOT):
    """Where a same-host reader asks for the prefill rank's whole cache: the unix socket `path`
    in the producer's private directory, which hands an authenticated reader the cache's memfd
    (SCM_RIGHTS). `pid` and `fd` are no longer sent (0): a reader never opens what a peer names.
    """

    pid: int
    fd: int
    num_blocks: int  # the cache's, not the request's
    path: str = ""
    size: int = 0  # the cache's bytes


class KVReply(msgspec.Struct, **_HOT):
    """The server's answer: one msgpack frame, then for a TCP READ one frame per block in the
    order asked, each `geometry.block_shape` of `geometry.dtype`, contiguous.

    `status`: "ok"; "unknown" (not exposed yet, or no longer: a reader retries until its own
    deadline); "refused" (a bad request: wrong secret, blocks, engine or transport).
    """

    nonce: int
    status: str
    message: str = ""
    geometry: KVGeometry | None = None
    shm: KVShmRef | None = None
