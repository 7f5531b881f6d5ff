"""KV-cache events in vLLM's format, for the routers that send a request where its prefix is
cached (vllm-router's `kv_aware`, llm-d, Dynamo).

The engine core's cache records what changes as it changes (`KVEventLog`): a block registered
in the prefix cache is `BlockStored`, one evicted is `BlockRemoved`, a cache forgotten at once
(`reset_prefix_cache`, sleep, a weight update) is `AllBlocksCleared`. The changes leave as one
msgpack `KVEventBatch` after each scheduling (blocks are registered as they are scheduled, so a
router hears of a prefill while it computes), each step and each operation, over a ZMQ PUB socket
(`KVEventPublisher`), in vLLM's frames `[topic, sequence number (8 bytes, big-endian),
payload]`, numbered from 0; a ROUTER socket, where configured, resends the batches from a
sequence number on: a request `[b"", 8-byte start]` is answered with `[b"", topic, seq,
payload]` per batch kept, then `[b"", b"", -1, b""]` (the frames vllm-router reads; vLLM's own
publisher leaves the topic out).

Block hashes go out as vLLM's `ExternalBlockHash`: the last 8 bytes of the block's SHA-256,
as an unsigned big-endian integer. They are opaque names (each process chains its hashes from
a random root, `kv_cache.NONE_HASH`): a consumer learns a block's content from the token ids
of its `BlockStored` and matches a prompt's blocks by those, chained by `parent_block_hash`.

The events carry prompt token ids, so they are a tenant's data: blocks of a request with a
`cache_salt` (the client's, or the one `--prefix-cache-isolation key` makes) and blocks of a
prompt given as embeddings are never published, nor their removal. A block computed with a
LoRA adapter is published with the adapter's id and name, so a consumer matches it only for
requests that name the same adapter.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import trio
import zmq

from triode.wire import Socket
from triode.wire.json_config import parse_config

log = logging.getLogger(__name__)

# vLLM's name for the tier its scheduler's own KV cache lives in (`MEDIUM_GPU`): consumers read
# it as "computed here, no transfer", which is what this cache is, on any device.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A replay request is one 8-byte frame after the ROUTER's identity and delimiter; anything
# larger is dropped by ZMQ before it is read.
MAX_REPLAY_REQUEST = 64
# The most batches kept for replay or queued: each is about half a KiB for a step of decodes,
# more for prefills; vLLM's defaults are 10,000 and 100,000.
MAX_BATCHES_KEPT = 1_000_000


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`--kv-events-config`, in vLLM's spelling. `endpoint` is bound (the publisher is the stable
    side; consumers connect), on loopback unless the operator names another address; a
    data-parallel engine core `r` binds the port plus `r`, as vLLM's do."""

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] | None = None  # None: zmq when enabled
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "max_queue_size"):
            if not 1 <= getattr(self, name) <= MAX_BATCHES_KEPT:
                raise ValueError(f"kv_events_config.{name} must be 1 to {MAX_BATCHES_KEPT}")
        if self.hwm < 0:
            raise ValueError("kv_events_config.hwm must be >= 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(value: str | dict[str, Any] | KVEventsConfig) -> KVEventsConfig:
    """A config from its JSON text (the CLI's, at most 4096 characters), a dict, or itself;
    ValueError when invalid."""
    return parse_config(value, KVEventsConfig, "kv_events_config", max_chars=4096)


def endpoint_of_rank(endpoint: str, rank: int) -> str:
    """`endpoint` with its TCP port moved up by the data-parallel rank (vLLM's rule); other
    transports get a `_dp{rank}` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def kv_event_sources(config: dict[str, Any] | None, ranks: int) -> dict[str, dict[str, Any]]:
    """Where each data-parallel rank publishes, keyed by rank (as text), in the shape a router
    discovers sources by (vllm-router's `/kv_event_sources`); empty when none publishes."""
    if config is None:
        return {}
    replay = config.get("replay_endpoint")
    return {
        str(rank): {
            **config,
            "endpoint": endpoint_of_rank(config["endpoint"], rank),
            "replay_endpoint": None if replay is None else endpoint_of_rank(replay, rank),
            "publisher": "zmq",
            "encoding": "msgpack",
            "schema_version": 1,
        }
        for rank in range(ranks)
    }


class KVCacheEvent(msgspec.Struct, gc=False, tag=True):
    """One change to the cache (vLLM's `KVCacheEvent`): a map tagged `"type": <class name>`,
    every field present, None or not (consumers require the keys)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`[ts, events, data_parallel_rank]`: an array, as vLLM's `EventBatch`."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """vLLM's `ExternalBlockHash` of a block hash."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventLog:
    """The cache's changes since the last `take`, as events. Only blocks of published requests
    are told of, and only their removal afterwards."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[Event] = []
        self._published: set[bytes] = set()

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: list[int],
        lora: tuple[int, str] | None,
    ) -> None:
        """Blocks just registered, in chain order; `parent` is the hash of the block before
        the first (None: it starts the prompt); `token_ids` theirs, `block_size` each."""
        self._published.update(hashes)
        lora_id, lora_name = lora if lora is not None else (None, None)
        self.events.append(
            BlockStored(
                block_hashes=[external_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=token_ids,
                block_size=self.block_size,
                lora_id=lora_id,
                medium=MEDIUM,
                lora_name=lora_name,
            )
        )

    def removed(self, block_hash: bytes) -> None:
        """A block evicted; consecutive removals share one event."""
        if block_hash not in self._published:
            return
        self._published.discard(block_hash)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)], MEDIUM))

    def cleared(self) -> None:
        self._published.clear()
        self.events = [AllBlocksCleared()]

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class KVEventPublisher:
    """The PUB socket's and the replay socket's one owner: sends each batch under the topic
    with the next sequence number, keeps the last `buffer_steps` for replay, and answers
    replay requests. Its `log` is what the cache records its changes in (`flush` sends them)."""

    def __init__(
        self,
        config: KVEventsConfig,
        context: zmq.Context,
        *,
        block_size: int,
        data_parallel_rank: int = 0,
    ) -> None:
        self.config = config
        self.log = KVEventLog(block_size)
        self.rank = data_parallel_rank
        self.endpoint = endpoint_of_rank(config.endpoint, data_parallel_rank)
        replay = config.replay_endpoint
        self.replay_endpoint = None if replay is None else endpoint_of_rank(replay, self.rank)
        self._context = context
        self._send, self._inbox = trio.open_memory_channel[KVEventBatch](config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.seq = 0  # the next batch's
        self.dropped = 0  # batches the queue had no room for
        self.bad_replay_requests = 0

    def flush(self) -> None:
        """Queue what `log` recorded since the last flush (`publish`)."""
        self.publish(self.log.take())

    def publish(self, events: list[Event]) -> None:
        """Queue a step's events; never waits. A full queue drops the batch (counted): the
        step must not wait on its consumers."""
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        try:
            self._send.send_nowait(batch)
        except trio.WouldBlock:
            self.dropped += 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        pub = Socket.open(self._context, zmq.PUB, bind=self.endpoint, hwm=self.config.hwm)
        async with pub, trio.open_nursery() as nursery:
            if self.replay_endpoint is not None:
                # at most one replay's answer waits per peer; a peer that does not read
                # loses the rest (ROUTER drops past its high-water mark)
                router = Socket.open(
                    self._context,
                    zmq.ROUTER,
                    bind=self.replay_endpoint,
                    hwm=self.config.buffer_steps + 1,
                    options=[(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST)],
                )
                nursery.start_soon(self._serve_replay, router)
            log.info(
                "publishing KV-cache events on %s%s",
                self.endpoint,
                "" if self.replay_endpoint is None else f" (replay: {self.replay_endpoint})",
            )
            task_status.started()
            encoder = msgspec.msgpack.Encoder()
            async for batch in self._inbox:
                payload = encoder.encode(batch)
                seq = self.seq
                self.seq += 1
                self._buffer.append((seq, payload))
                await pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    async def _serve_replay(self, router: Socket) -> None:
        async with router:
            while True:
                frames = await router.recv_multipart(copy=True)
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    self.bad_replay_requests += 1
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        frames = [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                        await router.send_multipart(frames)
                await router.send_multipart([client, b"", b"", END_SEQ, b""])
