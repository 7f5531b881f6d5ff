"""KV-cache events in vLLM's format (`actors/core/kv_events.py`): what the cache records as it
changes, the bytes on the wire, the publisher's framing and replay over real ZMQ sockets, and
an engine that publishes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq
from processes import alive

from triode.actors import SamplingParams, open_engine
from triode.actors.core.kv_cache import KVCacheManager, salt_root
from triode.actors.core.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    KVEventPublisher,
    external_hash,
    parse_kv_events_config,
)
from triode.actors.core.request import Request
from triode.wire import SamplingParams as WireParams
from triode.wire import Socket
from triode.wire.ports import free_port

SIZE = 4


def _manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, SIZE, events=KVEventLog(SIZE))


def _request(request_id: str, tokens: list[int], **options: Any) -> Request:
    return Request(request_id, tokens, WireParams(max_tokens=4), **options)


def _admit(kv: KVCacheManager, req: Request) -> None:
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * SIZE, hits) is not None
    req.num_computed_tokens = req.num_tokens


def _events(kv: KVCacheManager) -> list[Any]:
    assert kv.events is not None
    return kv.events.take()


def test_full_blocks_are_stored_once_chained_on_their_parent() -> None:
    kv = _manager()
    first = _request("a", list(range(1, 15)))  # 3 full blocks and 2 tokens
    _admit(kv, first)
    [stored] = _events(kv)
    hashes = [external_hash(h) for h in first.block_hashes[:3]]
    assert stored == BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(1, 13)),
        block_size=SIZE, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    # the same 2 blocks, then its own: only the new block, on the second as parent
    second = _request("b", [*range(1, 9), 50, 51, 52, 53, 54])
    _admit(kv, second)
    [stored] = _events(kv)
    assert stored.block_hashes == [external_hash(second.block_hashes[2])]
    assert stored.parent_block_hash == hashes[1]
    assert stored.token_ids == [50, 51, 52, 53]
    assert _events(kv) == []  # taken


def test_an_evicted_block_is_removed_and_a_cleared_cache_says_so_alone() -> None:
    kv = _manager(num_blocks=4)
    req = _request("a", list(range(1, 10)))  # 2 full blocks, 3 slots
    _admit(kv, req)
    kv.free(req)
    _events(kv)
    taker = _request("b", list(range(100, 116)))  # 4 blocks: both cached ones are evicted
    _admit(kv, taker)
    events = _events(kv)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1  # one event for the run of evictions
    assert sorted(removed[0].block_hashes) == sorted(external_hash(h) for h in req.block_hashes)
    assert isinstance(events[-1], BlockStored)
    kv.forget_prefixes()
    assert _events(kv) == [AllBlocksCleared()]
    kv.free(taker)
    assert _events(kv) == []  # forgotten blocks are not removed again


def test_salted_and_embedded_prompts_are_never_published_nor_their_eviction() -> None:
    kv = _manager(num_blocks=4)
    salted = _request("s", list(range(1, 10)), cache_salt="tenant", hash_root=salt_root("tenant"))
    _admit(kv, salted)
    assert _events(kv) == []
    kv.free(salted)
    _admit(kv, _request("b", list(range(100, 116))))
    assert _events(kv)[0] == BlockStored(
        [external_hash(h) for h in kv.req_blocks and _request_hashes(kv, "b")],
        None,
        list(range(100, 116)),
        SIZE,
        None,
        "GPU",
    )  # no BlockRemoved for the salted blocks it evicted


def _request_hashes(kv: KVCacheManager, request_id: str) -> list[bytes]:
    return [block.block_hash for block in kv.req_blocks[request_id] if block.block_hash]


def test_the_batch_is_an_array_of_tagged_maps_with_every_key() -> None:
    """What vllm-router 0.1.17 decodes: the batch an array, each event a map with a "type" and
    every field, None or not."""
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"),
            BlockStored([9], 7, [1, 2, 3, 4], 4, 3, "GPU", lora_name="sql"),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    stored = {"block_size": 4, "medium": "GPU"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [2**64 - 1, 7], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "lora_id": None, "lora_name": None, **stored},
            {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7,
             "token_ids": [1, 2, 3, 4], "lora_id": 3, "lora_name": "sql", **stored},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]  # fmt: skip


def test_events_are_off_and_on_loopback_unless_the_operator_says_otherwise() -> None:
    """They carry prompt token ids: nothing is published unless asked, and then on loopback."""
    config = parse_kv_events_config("{}")
    assert not config.publishes
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config.publishes and config.endpoint == "tcp://127.0.0.1:5557"
    assert config.replay_endpoint is None
    off = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not off.publishes


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": true, "max_queue_size": 1000001}', "max_queue_size"),
        ('{"topic": "' + "t" * 5000 + '"}', "4096 characters"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_config_is_refused_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_kv_events_config(text)


async def test_the_publisher_frames_batches_and_replays_them_from_a_sequence_number() -> None:
    port, replay_port = free_port(), free_port()
    config = parse_kv_events_config(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv", "buffer_steps": 2}
    )  # fmt: skip
    context = zmq.Context()
    publisher = KVEventPublisher(config, context, block_size=SIZE)
    sub = Socket.open(context, zmq.SUB, connect=f"tcp://127.0.0.1:{port}", subscribe=b"kv")
    async with trio.open_nursery() as nursery, sub:
        await nursery.start(publisher.run)
        with trio.fail_after(10):
            # PUB drops what it sends before the subscription arrives: send until one lands
            while True:
                publisher.publish([AllBlocksCleared()])
                with trio.move_on_after(0.05):
                    first = await sub.recv_multipart(copy=True)
                    break
            start = int.from_bytes(first[1], "big")
            for i in range(3):
                publisher.publish([BlockRemoved([i], "GPU")])
            frames = [await sub.recv_multipart(copy=True) for _ in range(3)]
        assert [f[0] for f in frames] == [b"kv"] * 3
        assert [int.from_bytes(f[1], "big") for f in frames] == [start + 1, start + 2, start + 3]
        batches = [msgspec.msgpack.decode(f[2], type=KVEventBatch) for f in frames]
        assert [b.events for b in batches] == [[BlockRemoved([i], "GPU")] for i in range(3)]
        assert {b.data_parallel_rank for b in batches} == {0}
        publisher.publish([])  # nothing to tell: nothing sent
        replay = f"tcp://127.0.0.1:{replay_port}"
        dealer = Socket.open(context, zmq.DEALER, connect=replay)
        oversized = Socket.open(context, zmq.DEALER, connect=replay)
        async with dealer, oversized:
            with trio.fail_after(10):
                # hostile requests: too large to be read (ZMQ drops the peer), wrong frame
                # count, wrong length
                await oversized.send_multipart([b"", b"x" * 4096])
                await dealer.send_multipart([b"", b"123"])
                await dealer.send_multipart([b"", b"1", b"2"])
                await dealer.send_multipart([b"", (start + 2).to_bytes(8, "big")])
                replies = []
                while not replies or replies[-1][2:3] != [END_SEQ]:
                    replies.append(await dealer.recv_multipart(copy=True))
        # the buffer keeps the last 2: from start + 2 on, as [b"", topic, seq, payload]
        assert [r[:2] for r in replies[:-1]] == [[b"", b"kv"]] * 2
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [start + 2, start + 3]
        assert replies[0][3] == frames[1][2] and replies[1][3] == frames[2][2]
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        assert publisher.bad_replay_requests == 2  # the oversized one never arrived
        nursery.cancel_scope.cancel()
    context.term()


def test_a_full_queue_drops_the_batch_and_counts_it() -> None:
    config = parse_kv_events_config({"enable_kv_cache_events": True, "max_queue_size": 1})
    publisher = KVEventPublisher(config, zmq.Context.instance(), block_size=SIZE)
    publisher.publish([AllBlocksCleared()])
    publisher.publish([AllBlocksCleared()])
    assert publisher.dropped == 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triode.gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("kv-events") / "tiny", num_layers=2)


async def test_an_engine_publishes_its_cache_per_rank_and_clears_on_reset(
    tiny_model: Path,
) -> None:
    port = free_port()
    while True:  # two consecutive free ports: rank 1 binds the next
        other = free_port()
        if other == port + 1:
            break
        port = other
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    context = zmq.Context()
    subs = [
        Socket.open(context, zmq.SUB, connect=f"tcp://127.0.0.1:{port + r}", subscribe=b"")
        for r in range(2)
    ]
    prompts = [[7 + i, *range(20, 20 + 4 * 16)] for i in range(2)]  # 65 tokens: 4 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    async with open_engine(
        str(tiny_model), dtype="float32", kv_cache_memory="16MiB", max_model_len=512,
        data_parallel_size=2, kv_events_config=config,
    ) as engine:  # fmt: skip
        pids = engine.pids
        stored: dict[int, list[list[int]]] = {0: [], 1: []}
        arrived = trio.Event()

        async def until(done: Callable[[], bool]) -> None:
            nonlocal arrived
            while not done():
                await arrived.wait()
                arrived = trio.Event()

        async with subs[0], subs[1], trio.open_nursery() as nursery:

            async def listen(rank: int) -> None:
                while True:
                    _, _, payload = await subs[rank].recv_multipart(copy=True)
                    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
                    assert batch.data_parallel_rank == rank
                    for event in batch.events:
                        if isinstance(event, BlockStored):
                            stored[rank].append(event.token_ids)
                        if isinstance(event, AllBlocksCleared):
                            stored[rank].append([-1])
                    arrived.set()

            for rank in range(2):
                nursery.start_soon(listen, rank)
            await trio.sleep(0.5)  # the subscriptions reach the PUB sockets
            with trio.fail_after(60):
                async with trio.open_nursery() as requests:
                    for prompt in prompts:
                        requests.start_soon(_generate, engine, prompt, params)
                await until(lambda: sum(len(s) for s in stored.values()) >= 2)
                # each prompt's 4 full blocks, on the rank that ran it
                assert sorted(tokens for s in stored.values() for tokens in s) == sorted(
                    p[:64] for p in prompts
                )
                assert all(stored.values())  # both ranks ran one
                assert await engine.admin.reset_prefix_cache()
                await until(lambda: all(s[-1] == [-1] for s in stored.values()))
            nursery.cancel_scope.cancel()
    context.term()
    assert not any(alive(pid) for pid in pids)


async def _generate(engine: Any, prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(prompt, params):
        pass
