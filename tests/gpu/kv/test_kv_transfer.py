"""The KV connector end to end in one process: a prefill scheduler and runner hand a prompt's
blocks to a decode scheduler and runner over each transport, through real ZMQ sockets and (for
shm) a real memfd; the decode then computes only the prompt's last token and its greedy output
equals a colocated run's. Faults: a dead or mismatched producer, a bad payload, aborts."""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from kv_secret import secret_file

from triode.actors.core.kv_connector import KVConnectorScheduler
from triode.actors.core.scheduler import Scheduler
from triode.actors.core.scheduler_config import SchedulerConfig
from triode.gpu.kv.connector import FinishedTransfers
from triode.gpu.kv.loader import KVLoader
from triode.gpu.kv.shm import MAX_FRAME_BYTES, HandoffError, receive_cache, shared_cache
from triode.gpu.kv.transport import CUT_BYTES, MAX_REQUEST_BYTES, KVServer, RequestAuth
from triode.gpu.model_runner import ModelRunner
from triode.gpu.tiny_model import build_tiny_model
from triode.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from triode.wire.kv_seal import prompt_digest, seal, seal_remote_decode
from triode.wire.kv_transfer import (
    KVConnectorOutput,
    KVExpose,
    KVLoad,
    KVReply,
    KVRequest,
    KVShmRef,
    KVTransferConfig,
)

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


def _secret(instance: _Instance) -> bytes:
    assert instance.scheduler.connector is not None
    return instance.scheduler.connector.secret


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
        params = _remote_params(f"tcp://127.0.0.1:{port}")
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
        dealer.send(msgspec.msgpack.encode(RequestAuth(_secret(producer)).sign(done)))
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


# The transports alone: a KV server over a small cache, and loaders, with no model.

SECRET = b"s" * 32
SHAPE = (2, 2, 8, 4, 1, 2)  # layers, K/V, blocks, block size, heads, head dim
EXPOSED = KVExpose("r", [1, 2, 3], "token")


def _cache(shm: bool = False) -> tuple[torch.Tensor, int | None]:
    cache, fd = shared_cache(SHAPE, torch.float32) if shm else (torch.zeros(SHAPE), None)
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(SHAPE))
    return cache, fd


def _request(op: str = "read", block_ids: list[int] | None = None, **fields: Any) -> KVRequest:
    ids = [1, 2] if block_ids is None else block_ids
    return KVRequest(op, 7, "engine", "r", "token", ids, **fields)


def _load(endpoint: str, request_id: str = "d", transport: str = "tcp") -> KVLoad:
    return KVLoad(request_id, [4, 5], [1, 2], "r", "engine", [endpoint], "token", transport)


def _until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class _Silent:
    """A peer that takes requests and answers none: a stalled or dead-slow producer."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seen: list[KVRequest] = []

    def next_read(self) -> tuple[bytes, KVRequest]:
        """The next READ's sender and request, past any DONE before it."""
        while True:
            assert self.socket.poll(20_000), "no READ came"
            identity, frame = self.socket.recv_multipart()
            request = msgspec.msgpack.decode(frame, type=KVRequest)
            if request.op == "read":
                return identity, request

    def ops(self, n: int) -> list[str]:
        """The ops of the first `n` requests that came (waiting for them)."""
        while len(self.seen) < n:
            assert self.socket.poll(20_000), f"{len(self.seen)} requests came, not {n}"
            _, frame = self.socket.recv_multipart()
            self.seen.append(msgspec.msgpack.decode(frame, type=KVRequest))
        return [r.op for r in self.seen]


def test_request_auth_takes_its_own_requests_once_within_the_window() -> None:
    now = [1000.0]
    signer = RequestAuth(SECRET, clock=lambda: now[0])
    checker = RequestAuth(SECRET, window=30.0, clock=lambda: now[0])
    request = signer.sign(_request())
    assert checker.check(request) is None
    assert "replayed" in str(checker.check(request))
    for field, value in [("op", "done"), ("nonce", 8), ("engine_id", "x"), ("request_id", "q"),
                         ("secret", "t"), ("block_ids", [1, 3]), ("transport", "shm"),
                         ("timestamp", request.timestamp + 1)]:  # fmt: skip
        altered = msgspec.structs.replace(request, **{field: value})
        assert "MAC" in str(checker.check(altered)), field
    assert "MAC" in str(RequestAuth(b"t" * 32).check(signer.sign(_request())))
    assert "MAC" in str(checker.check(_request()))  # unsigned
    # the secret itself is not the key: a MAC keyed with it proves nothing
    raw = _request(timestamp=now[0])
    raw.mac = hmac.new(SECRET, msgspec.msgpack.encode(raw), hashlib.sha256).digest()
    assert "MAC" in str(checker.check(raw))
    stale = signer.sign(_request())
    now[0] += 31
    assert "window" in str(checker.check(stale))
    future = signer.sign(_request())
    now[0] -= 62
    assert "window" in str(checker.check(future))
    nan = RequestAuth(SECRET, clock=lambda: math.nan).sign(_request())
    assert "window" in str(checker.check(nan))


def _ask(dealer: zmq.Socket, frames: list[bytes]) -> tuple[KVReply, list[bytes]]:
    dealer.send_multipart(frames)
    assert dealer.poll(10_000), "the server did not answer"
    header, *payload = dealer.recv_multipart()
    return msgspec.msgpack.decode(header, type=KVReply), payload


def test_the_kv_server_refuses_and_counts_every_hostile_request_and_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each hostile shape sent to a live server is answered "refused" and counted; the thread
    lives on, through a frame past the cut and an error while answering, and then
    serves a good read."""
    cache, _ = _cache()
    server = KVServer("tcp://127.0.0.1:*", cache, engine_id="engine", secret=SECRET)
    server.expose([EXPOSED])
    auth = RequestAuth(SECRET)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.endpoint)
    replayed = msgspec.msgpack.encode(auth.sign(_request()))
    hostile: dict[str, list[bytes]] = {
        "undecodable": [b"\xc1garbage"],
        "not a request": [msgspec.msgpack.encode({"op": "read"})],
        "two frames": [msgspec.msgpack.encode(auth.sign(_request())), b"x"],
        "oversized": [  # signed, and well-formed but for its size
            msgspec.msgpack.encode(
                auth.sign(msgspec.structs.replace(_request(), request_id="r" * MAX_REQUEST_BYTES))
            )
        ],
        "unsigned": [msgspec.msgpack.encode(_request())],
        "foreign MAC": [msgspec.msgpack.encode(RequestAuth(b"t" * 32).sign(_request()))],
        "replayed": [replayed],
        "wrong op": [msgspec.msgpack.encode(auth.sign(_request("write")))],
        "wrong transport": [msgspec.msgpack.encode(auth.sign(_request(transport="rdma")))],
        "wrong engine": [
            msgspec.msgpack.encode(auth.sign(msgspec.structs.replace(_request(), engine_id="e2")))
        ],
        "no blocks": [msgspec.msgpack.encode(auth.sign(_request(block_ids=[])))],
        "a block twice": [msgspec.msgpack.encode(auth.sign(_request(block_ids=[1, 1])))],
        "past the cache": [msgspec.msgpack.encode(auth.sign(_request(block_ids=[1, 8])))],
        "negative": [msgspec.msgpack.encode(auth.sign(_request(block_ids=[-1])))],
        "not exposed": [msgspec.msgpack.encode(auth.sign(_request(block_ids=[1, 4])))],
        "wrong token": [
            msgspec.msgpack.encode(auth.sign(msgspec.structs.replace(_request(), secret="x")))
        ],
    }
    try:
        assert _ask(dealer, [replayed])[0].status == "ok"  # its first time
        for i, (shape, frames) in enumerate(hostile.items(), 1):
            reply, payload = _ask(dealer, frames)
            assert (reply.status, payload) == ("refused", []), shape
            assert server.protocol_errors == i, shape
        # past the cut: ZMQ drops the peer before the frame is buffered
        big = context.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(server.endpoint)
        big.send(b"\x00" * (CUT_BYTES + 1))
        assert not big.poll(500)
        big.close()
        # an error while answering is a refused request, not a dead thread
        failing = monkeypatch.context()
        with failing as patch:
            patch.setattr(server, "_lookup", lambda request: 1 / 0)
            dealer.send(msgspec.msgpack.encode(auth.sign(_request())))
            _until(lambda: server.protocol_errors == len(hostile) + 1)
        reply, payload = _ask(dealer, [msgspec.msgpack.encode(auth.sign(_request()))])
        assert reply.status == "ok" and len(payload) == 2
        assert payload[0] == cache[:, :, 1].contiguous().numpy().tobytes()
        assert server._thread.is_alive()
    finally:
        dealer.close()
        context.term()
        server.close()


def _handoff(path: str, request: KVRequest) -> tuple[KVReply, list[int]]:
    """Ask a hand-off for the cache as a reader would, but taking whatever fds come."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(path)
        frame = msgspec.msgpack.encode(request)
        connection.sendall(len(frame).to_bytes(4, "little") + frame)
        data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
            data += connection.recv(1 << 16)
    return msgspec.msgpack.decode(data[4:], type=KVReply), fds


def test_the_handoff_gives_the_cache_fd_only_to_an_authenticated_reader_of_exposed_blocks() -> None:
    cache, fd = _cache(shm=True)
    assert fd is not None
    server = KVServer("tcp://127.0.0.1:*", cache, engine_id="engine", secret=SECRET, shm_fd=fd)
    server.expose([EXPOSED])
    auth = RequestAuth(SECRET)
    try:
        assert server.handoff is not None
        directory = os.path.dirname(server.handoff.path)
        info = os.lstat(directory)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        for request in [
            _request(transport="shm"),  # unsigned
            auth.sign(_request(transport="shm", block_ids=[1, 4])),  # not the request's
            auth.sign(msgspec.structs.replace(_request(transport="shm"), request_id="q")),
            auth.sign(_request()),  # a tcp read
        ]:
            reply, fds = _handoff(server.handoff.path, request)
            assert reply.status in ("refused", "unknown") and fds == []
        # the largest frame it reads is MAX_FRAME_BYTES: a larger length is refused unread
        errors = server.protocol_errors
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(10)
            connection.connect(server.handoff.path)
            connection.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "little"))
            assert connection.recv(16) == b""  # closed, nothing sent
        _until(lambda: server.protocol_errors == errors + 1)
        reply, fds = _handoff(server.handoff.path, auth.sign(_request(transport="shm")))
        assert reply.status == "ok" and len(fds) == 1
        info = os.fstat(fds[0])
        assert info.st_size == cache.numel() * 4 and os.path.samestat(info, os.fstat(fd))
        os.close(fds[0])
        # who can reach it: not another user, who cannot enter the directory
        if os.getuid() == 0:
            assert _connect_as_nobody(server.handoff.path) == errno.EACCES
    finally:
        server.close()
        os.close(fd)
    assert not os.path.exists(directory)


def _connect_as_nobody(path: str) -> int:
    """The errno of connecting to `path` from a child process that became uid 65534."""
    pid = os.fork()
    if pid == 0:  # the child does nothing but this, and leaves without cleaning up
        code = 0
        try:
            os.setuid(65534)
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
        except OSError as e:
            code = e.errno or 255
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def silent() -> Any:
    """Makes silent peers, closed after the test."""
    context = zmq.Context()
    peers: list[_Silent] = []

    def make() -> _Silent:
        peers.append(_Silent(context))
        return peers[-1]

    yield make
    for peer in peers:
        peer.socket.close(linger=0)
    context.term()


def test_a_reader_maps_no_memory_a_peer_names(silent: Any, tmp_path: Path) -> None:
    """A producer's shm reply that names memory (another process's fd by pid, a socket outside
    a private directory) gets nothing mapped: the load fails and the cache stays as it was."""
    target, _ = _cache()
    before = target.clone()
    bait_fd = os.memfd_create("bait")  # a cache-sized memfd of 7s, reachable by pid and fd
    os.write(bait_fd, torch.full(SHAPE, 7.0).numpy().tobytes())
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    bait_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bait_socket.bind(str(open_dir / "cache.sock"))
    bait_socket.listen(1)
    bait_socket.setblocking(False)
    producer = silent()
    loader = KVLoader(0, target, timeout=5.0, secret=SECRET)
    geometry = loader.geometry
    size = cache_bytes = target.numel() * 4
    refs = [
        KVShmRef(os.getpid(), bait_fd, SHAPE[2], size=cache_bytes),
        KVShmRef(os.getpid(), bait_fd, SHAPE[2], path=f"/proc/{os.getpid()}/fd/{bait_fd}",
                 size=size),
        KVShmRef(0, 0, SHAPE[2], path=str(open_dir / "cache.sock"), size=size),
    ]  # fmt: skip
    try:
        for i, ref in enumerate(refs):
            loader.submit(_load(producer.endpoint, f"d{i}", "shm"))
            identity, request = producer.next_read()
            reply = KVReply(request.nonce, "ok", geometry=geometry, shm=ref)
            producer.socket.send_multipart([identity, msgspec.msgpack.encode(reply)])
            _until(lambda: loader.in_flight == 0)
            assert torch.equal(target, before), f"{ref} was mapped"
            assert loader.take() == ([], [f"d{i}"])
        assert loader.protocol_errors == len(refs)
        with pytest.raises(BlockingIOError):
            bait_socket.accept()  # nobody connected to the socket in the open directory
    finally:
        loader.close()
        bait_socket.close()
        os.close(bait_fd)


def _fake_handoff(directory: str, fd: int) -> threading.Thread:
    """A hand-off in a private directory that grants `fd` to whoever asks, once."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(directory, "cache.sock"))
    listener.listen(1)

    def serve() -> None:
        with listener, listener.accept()[0] as connection:
            connection.recv(1 << 16)  # whatever was asked
            reply = msgspec.msgpack.encode(KVReply(0, "ok"))
            socket.send_fds(connection, [len(reply).to_bytes(4, "little") + reply], [fd])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_reader_takes_only_a_memfd_sealed_at_the_caches_size(tmp_path: Path) -> None:
    size = 4096
    plain = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, size)
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, size)
    _, small = shared_cache((1, 1, 1, 8), torch.float32)  # sealed, 32 bytes
    _, right = shared_cache((1, 1, 1, size // 4), torch.float32)
    try:
        for fd, good in [(plain, False), (unsealed, False), (small, False), (right, True)]:
            directory = tempfile.mkdtemp(dir=tmp_path)
            thread = _fake_handoff(directory, fd)
            path = os.path.join(directory, "cache.sock")
            if good:
                _, got = receive_cache(path, b"ask", size, time.monotonic() + 10)
                assert got is not None
                os.close(got)
            else:
                with pytest.raises(HandoffError, match=r"cache of|memfd"):
                    receive_cache(path, b"ask", size, time.monotonic() + 10)
            thread.join()
        # and a private directory that is not mode 0700 is not entered
        loose = tempfile.mkdtemp(dir=tmp_path)
        os.chmod(loose, 0o750)
        with pytest.raises(HandoffError, match="private directory"):
            receive_cache(os.path.join(loose, "cache.sock"), b"ask", size, time.monotonic() + 10)
    finally:
        for fd in (plain, unsealed, small, right):
            os.close(fd)


def test_loads_run_concurrently_and_a_cancelled_one_stops_and_says_done(
    silent: Any,
) -> None:
    """A producer that never answers holds up only its own load; cancelling that load reports
    it failed and tells the producer DONE, so it can free the blocks."""
    cache, _ = _cache()
    server = KVServer("tcp://127.0.0.1:*", cache, engine_id="engine", secret=SECRET)
    server.expose([EXPOSED])
    stalled = silent()
    target = torch.zeros(SHAPE)
    loader = KVLoader(0, target, timeout=600.0, secret=SECRET, workers=2)
    try:
        loader.submit(_load(stalled.endpoint, "stalled"))
        _until(lambda: stalled.socket.poll(0))  # its READ is out, and unanswered
        loader.submit(_load(server.endpoint, "good"))
        _until(lambda: loader.in_flight == 1)
        assert loader.take() == (["good"], [])
        assert torch.equal(target[:, :, [4, 5]], cache[:, :, [1, 2]])
        assert server.take_done() == ["r"]
        loader.cancel(["stalled", "unknown"])
        _until(lambda: loader.in_flight == 0)
        assert loader.take() == ([], ["stalled"])
        assert stalled.ops(2) == ["read", "done"]
        assert loader.protocol_errors == 0
    finally:
        loader.close()
        server.close()


def test_a_loads_deadline_counts_from_its_submission(silent: Any) -> None:
    """With one thread, a load queued behind a stalled one is past its deadline when the
    thread is free, and fails without asking its producer."""
    now = [0.0]
    first, second = silent(), silent()
    loader = KVLoader(0, torch.zeros(SHAPE), timeout=10.0, secret=SECRET, workers=1,
                      clock=lambda: now[0])  # fmt: skip
    try:
        loader.submit(_load(first.endpoint, "first"))
        loader.submit(_load(second.endpoint, "second"))
        _until(lambda: first.socket.poll(0))
        now[0] = 10.5  # both deadlines passed
        _until(lambda: loader.in_flight == 0)
        assert loader.take() == ([], ["first", "second"])
        assert first.ops(2) == ["read", "done"]
        assert second.ops(1) == ["done"]  # never asked to READ
    finally:
        loader.close()


def test_finished_transfers_wait_for_every_rank_of_a_cancelled_load() -> None:
    tally = FinishedTransfers(world_size=2)
    assert tally.add([KVConnectorOutput(failed_recving=["d"])]).failed_recving == []
    assert tally.add([KVConnectorOutput(failed_recving=["d"])]).failed_recving == ["d"]


def test_an_aborted_load_stops_and_its_blocks_go_when_the_ranks_are_through(
    tiny: Path, silent: Any
) -> None:
    """A decode aborted while it loads from a producer that never answers: the load stops
    (its timeout is an hour), the producer hears DONE, and the blocks are freed only once the
    rank reported the load through."""
    producer = silent()
    consumer = _Instance(tiny, "kv_consumer", load_timeout=3600.0)
    try:
        params = _remote_params(producer.endpoint)
        consumer.add("d", _sealed(consumer, params), MAX_TOKENS)
        consumer.step()  # the load starts
        _until(lambda: producer.socket.poll(0))
        consumer.scheduler.abort_requests(["d"])
        assert consumer.scheduler.loading and consumer.scheduler.kv_cache.usage > 0
        consumer.run(consumer.idle)
        assert consumer.scheduler.kv_cache.usage == 0.0
        assert producer.ops(2) == ["read", "done"]
        # the id is free again, and the connector holds nothing of it
        connector = consumer.scheduler.connector
        assert connector is not None and not connector.loading and not connector.pending
    finally:
        consumer.close()


def _remote_params(endpoint: str, request_id: str = "p") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "fake",
        "remote_request_id": request_id,
        "remote_block_ids": [0, 1, 2],
        "remote_endpoints": [endpoint],
        "remote_num_tokens": len(PROMPT),
        "remote_secret": "s",
        "tp_size": 1,
        "pp_size": 1,
        "block_size": 16,
        "transport": "tcp",
    }


def test_loads_past_max_concurrent_loads_are_refused_for_now(tmp_path: Path) -> None:
    """The cap counts loads admitted and not through (waiting to start, or loading, aborted
    ones too until every rank is through); one past it is refused, to be retried (a 429)."""
    config = KVTransferConfig(
        kv_connector="TriodeConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"secret_file": secret_file(tmp_path), "max_concurrent_loads": 2},
    )
    connector = KVConnectorScheduler(config, block_size=16, endpoints=[])
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=16, max_model_len=256), connector
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    params = {"do_remote_prefill": True}

    def add(request_id: str, kv: dict[str, Any] | None = params) -> EngineCoreOutput | None:
        return scheduler.add_request(EngineCoreRequest(request_id, PROMPT, sampling,
                                                       kv_transfer_params=kv))  # fmt: skip

    assert add("a") is None and add("b") is None
    refused = add("c")
    assert refused is not None and refused.finish_reason is FinishReason.REFUSED
    assert "max_concurrent_loads" in str(refused.stop_reason)
    assert add("local", None) is None  # a request that loads nothing is not counted
    scheduler.abort_requests(["a"])  # waiting to start: its place is free at once
    assert add("c") is None
    assert add("e") is not None and connector.loads_refused == 2
    # a load under way keeps its place until it is through, aborted or not
    connector.loading.add("x")
    scheduler.abort_requests(["b"])
    assert add("f") is not None
    connector.load_done("x")
    assert add("f") is None
