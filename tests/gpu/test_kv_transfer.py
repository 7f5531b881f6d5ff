"""The KV connector end to end in one process: a prefill scheduler and runner hand a prompt's
blocks to a decode scheduler and runner over each transport, through real ZMQ sockets and (for
shm) a real memfd; the decode then computes only the prompt's last token and its greedy output
equals a colocated run's. Faults: a dead or mismatched producer, a bad payload, aborts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from kv_secret import secret_file

from triode.actors.kv_connector import KVConnectorScheduler
from triode.actors.scheduler import Scheduler, SchedulerConfig
from triode.gpu.model_runner import ModelRunner
from triode.gpu.testing import build_tiny_model
from triode.wire import EngineCoreOutput, EngineCoreRequest, SamplingParams
from triode.wire.kv_seal import prompt_digest, seal, seal_remote_decode
from triode.wire.kv_transfer import KVReply, KVRequest, KVTransferConfig

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(45)]  # 3 blocks of 16, the last partial
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, beside the deployment secret every instance here shares."""
    directory = tmp_path_factory.mktemp("kv")
    secret_file(directory)
    return build_tiny_model(directory / "tiny")


class _Instance:
    """A scheduler and a runner stepped by hand: an engine core without its processes."""

    def __init__(self, model: Path, role: str | None, transport: str = "tcp", **extra: Any):
        self.connector_config = None
        if role is not None:
            self.connector_config = msgspec.to_builtins(
                KVTransferConfig(
                    kv_connector="TriodeConnector",
                    kv_role=role,
                    kv_connector_extra_config={
                        "transport": transport,
                        "secret_file": str(model.parent / "kv.secret"),
                        **extra,
                    },
                )
            )
        self.runner = ModelRunner(
            model,
            dtype="float32",
            kv_cache_memory=1 << 20,
            max_model_len=256,
            num_threads=1,
            kv_transfer_config=self.connector_config,
        )
        connector = None
        if self.connector_config is not None:
            connector = KVConnectorScheduler(
                msgspec.convert(self.connector_config, KVTransferConfig),
                block_size=self.runner.block_size,
                endpoints=self.runner.kv_endpoints,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_kv_blocks,
                block_size=self.runner.block_size,
                max_model_len=256,
            ),
            connector,
        )
        self.outputs: dict[str, list[EngineCoreOutput]] = {}

    def add(self, request_id: str, params: dict[str, Any] | None, max_tokens: int) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = EngineCoreRequest(request_id, PROMPT, sampling, kv_transfer_params=params)
        assert self.scheduler.add_request(request) is None

    def step(self) -> None:
        sched = self.scheduler.schedule()
        out = self.runner.execute(sched)
        for outputs in self.scheduler.update_from_output(sched, out).values():
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)

    def run(self, until: Any, *peers: _Instance, timeout: float = 20.0) -> None:
        """Step this instance, and the `peers` beside it (as their engines would), until."""
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out"
            for instance in (self, *peers):
                instance.step()
            time.sleep(0.001)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def finished(self, request_id: str) -> bool:
        return any(o.finish_reason is not None for o in self.outputs.get(request_id, []))

    def idle(self) -> bool:
        s = self.scheduler
        return not s.requests and not s.loading and not s.held

    def close(self) -> None:
        self.runner.shutdown()


@pytest.fixture(scope="module")
def reference(tiny: Path) -> list[int]:
    alone = _Instance(tiny, None)
    alone.add("r", None, MAX_TOKENS)
    alone.run(lambda: alone.finished("r"))
    alone.close()
    return alone.tokens("r")


def _prefill(producer: _Instance, request_id: str) -> dict[str, Any]:
    assert producer.scheduler.connector is not None
    asked = seal_remote_decode(producer.scheduler.connector.secret, {"do_remote_decode": True})
    producer.add(request_id, asked, 1)
    producer.run(lambda: producer.finished(request_id))
    [last] = [o for o in producer.outputs[request_id] if o.finish_reason is not None]
    assert last.kv_transfer_params is not None
    return last.kv_transfer_params


def _sealed(instance: _Instance, params: dict[str, Any]) -> dict[str, Any]:
    """`params` sealed with the deployment's secret for `PROMPT`, as a prefill would."""
    assert instance.scheduler.connector is not None
    return seal(instance.scheduler.connector.secret, params, prompt_digest(PROMPT), ttl=60)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_decode_loads_the_prompt_and_matches_a_colocated_run(
    tiny: Path, reference: list[int], transport: str
) -> None:
    producer = _Instance(tiny, "kv_producer", transport)
    consumer = _Instance(tiny, "kv_consumer")
    try:
        params = _prefill(producer, "p")
        assert params["remote_num_tokens"] == len(PROMPT)
        assert len(params["remote_block_ids"]) == 3 and params["transport"] == transport
        assert producer.scheduler.held  # kept for the decode
        computed_before = consumer.scheduler.prompt_tokens_computed
        consumer.add("d", params, MAX_TOKENS)
        consumer.run(lambda: consumer.finished("d"), producer)
        assert consumer.tokens("d") == reference
        # only the prompt's last token was computed here; the rest came over
        assert consumer.scheduler.prompt_tokens_computed - computed_before == 1
        assert consumer.scheduler.prompt_tokens_transferred == len(PROMPT) - 1
        # the producer frees its blocks once the decode said DONE
        producer.run(producer.idle)
        assert producer.scheduler.kv_cache.usage == 0.0
        assert consumer.idle() and consumer.scheduler.kv_cache.usage == 0.0
        # the loaded blocks are in the decode's prefix cache
        consumer.add("again", None, MAX_TOKENS)
        consumer.run(lambda: consumer.finished("again"))
        assert consumer.tokens("again") == reference
        assert consumer.outputs["again"][0].num_cached_tokens == 32
    finally:
        producer.close()
        consumer.close()


def test_a_dead_producer_makes_the_decode_recompute(tiny: Path, reference: list[int]) -> None:
    producer = _Instance(tiny, "kv_producer")
    consumer = _Instance(tiny, "kv_consumer", load_timeout=0.5)
    try:
        params = _prefill(producer, "p")
        producer.close()  # its KV server is gone: nobody answers
        consumer.add("d", params, MAX_TOKENS)
        consumer.run(lambda: consumer.finished("d"))
        assert consumer.tokens("d") == reference
        assert consumer.scheduler.kv_load_failures == 1
        assert consumer.scheduler.prompt_tokens_computed == len(PROMPT)
        consumer.run(consumer.idle)
        assert consumer.scheduler.kv_cache.usage == 0.0
    finally:
        consumer.close()


def test_a_bad_payload_is_a_counted_protocol_error_and_the_decode_recomputes(
    tiny: Path, reference: list[int]
) -> None:
    """A KV server that answers READ with blocks of the wrong size."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    consumer = _Instance(tiny, "kv_consumer", load_timeout=2.0)
    try:
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "fake",
            "remote_request_id": "p",
            "remote_block_ids": [0, 1, 2],
            "remote_endpoints": [f"tcp://127.0.0.1:{port}"],
            "remote_num_tokens": len(PROMPT),
            "remote_secret": "s",
            "tp_size": 1,
            "pp_size": 1,
            "block_size": 16,
            "transport": "tcp",
        }
        consumer.add("d", _sealed(consumer, params), MAX_TOKENS)
        consumer.step()  # the load starts
        assert server.poll(5000)
        identity, frame = server.recv_multipart()
        request = msgspec.msgpack.decode(frame, type=KVRequest)
        geometry = consumer.runner.kv_connector.loader.geometry  # type: ignore[union-attr]
        reply = KVReply(request.nonce, "ok", geometry=geometry)
        server.send_multipart([identity, msgspec.msgpack.encode(reply), b"x" * 10, b"y", b"z"])
        consumer.run(lambda: consumer.finished("d"))
        assert consumer.tokens("d") == reference
        assert consumer.scheduler.kv_load_failures == 1
        assert consumer.scheduler.kv_protocol_errors == 1
        consumer.run(consumer.idle)
    finally:
        consumer.close()
        server.close(0)
        context.term()


def test_mismatched_params_recompute_without_a_load(tiny: Path, reference: list[int]) -> None:
    producer = _Instance(tiny, "kv_producer")
    consumer = _Instance(tiny, "kv_consumer")
    try:
        params = _prefill(producer, "p")
        consumer.add("d", _sealed(producer, {**params, "tp_size": 2}), MAX_TOKENS)
        consumer.run(lambda: consumer.finished("d"), producer)
        assert consumer.tokens("d") == reference
        assert consumer.scheduler.connector.load_refusals == 1  # type: ignore[union-attr]
        assert not consumer.scheduler.loading
    finally:
        producer.close()
        consumer.close()


def test_aborts_free_every_block_on_both_sides(tiny: Path) -> None:
    producer = _Instance(tiny, "kv_producer", hold_timeout=0.3)
    consumer = _Instance(tiny, "kv_consumer")
    try:
        params = _prefill(producer, "p")
        # abort the decode while its load runs: the blocks go once the load is through
        consumer.add("d", params, MAX_TOKENS)
        consumer.step()
        assert consumer.scheduler.loading
        consumer.scheduler.abort_requests(["d"])
        consumer.run(consumer.idle, producer)
        assert consumer.scheduler.kv_cache.usage == 0.0
        # a second prefill nobody reads: its hold times out
        _prefill(producer, "q")
        producer.run(producer.idle)
        assert producer.scheduler.kv_cache.usage == 0.0
        # and one aborted after it finished is freed at once
        _prefill(producer, "r")
        producer.scheduler.abort_requests(["r"])
        assert producer.idle() and producer.scheduler.kv_cache.usage == 0.0
    finally:
        producer.close()
        consumer.close()


def test_a_read_of_withdrawn_blocks_is_not_acknowledged(tiny: Path) -> None:
    """The consistency rule of the transport: DONE after a release is refused."""
    producer = _Instance(tiny, "kv_producer")
    try:
        params = _prefill(producer, "p")
        producer.step()  # exposes the blocks
        server = producer.runner.kv_connector.server  # type: ignore[union-attr]
        server.release(["p"])
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(params["remote_endpoints"][0])
        done = KVRequest(
            "done", 1, params["remote_engine_id"], "p", params["remote_secret"], transport="tcp"
        )
        dealer.send(msgspec.msgpack.encode(done))
        assert dealer.poll(5000)
        reply = msgspec.msgpack.decode(dealer.recv(), type=KVReply)
        assert reply.status == "unknown"
        dealer.close(0)
        context.term()
    finally:
        producer.close()


def test_the_tcp_payload_equals_the_producers_blocks(tiny: Path) -> None:
    producer = _Instance(tiny, "kv_producer")
    consumer = _Instance(tiny, "kv_consumer")
    try:
        params = _prefill(producer, "p")
        consumer.add("d", params, 1)
        consumer.run(lambda: consumer.finished("d"), producer)
        remote = producer.runner.kv_cache[:, :, params["remote_block_ids"]]
        local_ids = consumer.scheduler.kv_cache.block_ids("d") or None
        assert local_ids is None  # finished: freed
        # compare through the decode's prefix cache: its first two blocks are the prompt's
        hashes = consumer.scheduler.kv_cache.pool.cached
        assert len(hashes) >= 2
        ids = sorted(b.block_id for b in hashes.values())[:2]
        local = consumer.runner.kv_cache[:, :, ids]
        assert torch.equal(local, remote[:, :, :2])
    finally:
        producer.close()
        consumer.close()
