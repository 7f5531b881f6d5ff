"""Weights from a trainer: `WeightSyncClient` against the four HTTP calls, answered by a small
stand-in for the server's routes that hands each call to a real `WeightTransfer` whose loader
validates a whole bucket first, as `Operations.apply_weights` does.

shm runs the stand-in on a thread of this process; the broadcast runs it in a child process
(the engine rank, rank 1 of the group) with this process as the trainer (rank 0). Every test
checks what arrived bit for bit, and that no segment, listening socket or process is left.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from multiprocessing.connection import Connection
from typing import Any

import httpx
import pytest
import torch
from processes import alive, listening_sockets
from shm_segments import no_segment_outlives_a_test  # noqa: F401 - autouse

from triode.gpu.weight_transfer import WeightTransfer, mapped_weights, write_bucket
from triode.gpu.weight_transfer.client import WeightSyncClient, WeightSyncError, buckets
from triode.wire import OperationError
from triode.wire.shm_segment import unlink_untracked
from triode.wire.weight_update import ShmBucket, ShmUpdate

# the edge's answer to an OperationError of each kind
STATUS = {
    "invalid": (400, "BadRequestError"),
    "unsupported": (400, "BadRequestError"),
    "conflict": (409, "ConflictError"),
}


def _model() -> dict[str, torch.Tensor]:
    """Parameters under Hugging Face names, of the three dtypes weights come in; one (the
    embedding) larger than the tests' buckets."""
    return {
        "model.embed_tokens.weight": torch.zeros(64, 40),  # 10240 bytes
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(16, 16, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(24, 16, dtype=torch.float16),
        "model.layers.0.input_layernorm.weight": torch.zeros(16),
        "model.norm.weight": torch.zeros(16, dtype=torch.bfloat16),
    }


def _trained(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen).to(p.dtype) for name, p in _model().items()}


def _digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in tensors.items()
    }


class _Engine:
    """One engine rank's parameters and its `WeightTransfer`, behind the routes the server
    gives the four calls (plus /stats for the tests)."""

    def __init__(self) -> None:
        self.params = _model()
        self.transfer = WeightTransfer(
            self.apply, rank=0, device=torch.device("cpu"), check=self.check
        )
        self.version = 0
        self.stats = {"inits": 0, "buckets": 0}

    def check(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """Names only, before a broadcast's data exists; shapes and dtypes wait for `apply`,
        so both ways a bucket can be refused are taken."""
        for name, _, _ in specs:
            if name not in self.params:
                raise OperationError("invalid", f"{name}: no such parameter")

    def apply(self, weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        for name, tensor in weights:
            have = self.params.get(name)
            if have is None:
                raise OperationError("invalid", f"{name}: no such parameter")
            if (have.shape, have.dtype) != (tensor.shape, tensor.dtype):
                raise OperationError("invalid", f"{name}: not {tuple(have.shape)} {have.dtype}")
        for name, tensor in weights:
            self.params[name].copy_(tensor)
        self.stats["buckets"] += 1
        return {"loaded": len(weights)}

    def route(self, path: str, body: Any) -> dict[str, Any]:
        if path == "/get_world_size":
            return {"world_size": 1}
        if path == "/init_weight_transfer_engine":
            self.stats["inits"] += 1
            return self.transfer.init(body["init_info"], rank_offset=1)
        if path == "/start_weight_update":
            return {}
        if path == "/update_weights":
            return self.transfer.update(body["update_info"])
        if path == "/finish_weight_update":
            self.version += 1
            return {"weight_version": self.version}
        if path == "/stats":
            return {**self.stats, "digest": _digest(self.params)}
        raise KeyError(path)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._answer(None)

    def do_POST(self) -> None:
        self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def _answer(self, body: Any) -> None:
        try:
            status, answer = 200, self.server.engine.route(self.path, body)
        except OperationError as e:
            status, kind = STATUS[e.kind]
            answer = {"error": {"message": e.message, "type": kind, "param": None, "code": e.kind}}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(HTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.engine = _Engine()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


# shm


@pytest.fixture
def server() -> Iterator[_Server]:
    with _Server() as served:
        thread = threading.Thread(target=served.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield served
        finally:
            served.shutdown()
            thread.join()


def test_buckets_are_bounded_and_a_larger_tensor_goes_alone() -> None:
    cut = list(buckets(_trained(0).items(), 1024))
    assert [[name.split(".")[-2] for name, _ in b] for b in cut] == [
        ["embed_tokens"],  # 10240 bytes
        ["q_proj"],  # 512
        ["up_proj", "input_layernorm", "norm"],  # 768 + 64 + 32, at 64-byte offsets
    ]


def test_shm_moves_every_dtype_bit_for_bit_in_several_buckets(server: _Server) -> None:
    trained = _trained(1)
    with WeightSyncClient(server.url, backend="shm", bucket_bytes=1024) as client:
        assert client.update(trained.items()) == 1
    stats = server.engine.route("/stats", None)
    assert stats["buckets"] == 3
    assert stats["digest"] == _digest(trained)


def test_shm_segments_are_unlinked_and_nothing_loaded_when_the_server_refuses_a_bucket(
    server: _Server,
) -> None:
    bad = {"model.norm.weight": torch.ones(16, dtype=torch.bfloat16), "lm_head.w": torch.ones(4)}
    with WeightSyncClient(server.url, backend="shm") as client:
        with pytest.raises(WeightSyncError) as caught:
            client.update(bad.items())
    assert (caught.value.status, caught.value.code) == (400, "invalid")
    assert "lm_head.w: no such parameter" in str(caught.value)
    assert server.engine.route("/stats", None)["digest"] == _digest(_model())


def test_an_update_before_init_is_a_conflict(server: _Server) -> None:
    client = WeightSyncClient(server.url, backend="shm")
    try:
        with pytest.raises(WeightSyncError) as caught:
            client.send(_trained(2).items())
    finally:
        client.close()
    assert caught.value.status == 409
    assert "/init_weight_transfer_engine first" in caught.value.message


def test_a_rank_reads_segments_through_a_private_mapping_and_refuses_a_missing_one() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bucket = write_bucket([("w", tensor), ("empty", torch.ones(0, 2))])
    update = ShmUpdate([bucket])
    try:
        with mapped_weights(update) as weights:
            assert [name for name, _ in weights] == ["w", "empty"]
            weights[0][1].fill_(-1)  # a loader writing where it should not
        with mapped_weights(update) as weights:
            assert torch.equal(weights[0][1], tensor)  # the segment is untouched
            assert weights[1][1].shape == (0, 2)
        short = ShmUpdate([ShmBucket(bucket.shm_name, bucket.nbytes + 64, bucket.tensors)])
        with pytest.raises(OperationError, match="holds 48 bytes, not the 112 stated"):
            with mapped_weights(short):
                pass
    finally:
        unlink_untracked(bucket.shm_name)
    with pytest.raises(OperationError, match="does not exist") as caught:
        with mapped_weights(update):
            pass
    assert caught.value.kind == "invalid"


# broadcast


def _serve_engine(conn: Connection) -> None:
    """The engine rank's process: the stand-in server, until the test kills it."""
    torch.set_num_threads(1)
    with _Server() as served:
        conn.send(served.url)
        served.serve_forever()


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve_engine, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(60), "the engine process did not start"
        yield parent.recv()
    finally:
        process.kill()
        process.join(10)
    assert process.pid is not None and not alive(process.pid)


def _stats(url: str) -> dict[str, Any]:
    answer = httpx.get(url + "/stats")
    answer.raise_for_status()
    return answer.json()


def _listening() -> list[tuple[int, str, str, int]]:
    return listening_sockets([os.getpid()])


def test_broadcast_moves_every_dtype_bit_for_bit_and_tears_the_group_down(engine: str) -> None:
    before, listening = _stats(engine), _listening()
    trained = _trained(3)
    with WeightSyncClient(engine, backend="broadcast", bucket_bytes=1024, timeout=30) as client:
        group = set(_listening()) - set(listening)  # the store, and gloo's own socket
        assert group and {address for _, _, address, _ in group} == {"127.0.0.1"}
        version = client.update(trained.items())
    after = _stats(engine)
    assert after["digest"] == _digest(trained)
    assert (after["inits"], after["buckets"]) == (before["inits"] + 1, before["buckets"] + 3)
    assert version > 0
    assert _listening() == listening  # the trainer's store is gone with its group


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        # refused by `check` before anything is allocated: drained
        ({"lm_head.weight": torch.ones(3, 4)}, "lm_head.weight: no such parameter"),
        # refused by the loader once received
        ({"model.norm.weight": torch.ones(16)}, "model.norm.weight: not (16,) torch.bfloat16"),
    ],
)
def test_a_refused_bucket_is_received_to_its_end_and_the_group_stays_in_step(
    engine: str, wrong: dict[str, torch.Tensor], says: str
) -> None:
    trained = _trained(4)
    before = _stats(engine)
    with WeightSyncClient(engine, backend="broadcast", timeout=30) as client:
        client.start()
        with pytest.raises(WeightSyncError) as caught:
            client.send({**trained, **wrong}.items())  # one bucket
        assert caught.value.status == 400
        assert says in caught.value.message
        assert _stats(engine)["digest"] == before["digest"]  # the bucket was refused whole
        client.send(trained.items())  # through the same group
        client.finish()
    after = _stats(engine)
    assert after["digest"] == _digest(trained)
    assert after["inits"] == before["inits"] + 1


def test_an_update_info_that_does_not_decode_closes_the_group_and_the_trainer_rejoins(
    engine: str,
) -> None:
    trained = _trained(5)
    before = _stats(engine)
    with WeightSyncClient(engine, backend="broadcast", timeout=60) as client:
        hostile = {"names": ["x"], "dtype_names": ["complex128"], "shapes": [[1 << 20]]}
        answer = httpx.post(engine + "/update_weights", json={"update_info": hostile})
        assert answer.status_code == 400
        assert "the broadcast group is closed" in answer.json()["error"]["message"]
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as caught:
            client.send(trained.items())  # the engine left: the broadcast fails at once
        assert time.monotonic() - start < 10
        assert caught.value.status == 409
        assert client.update(trained.items()) > 0  # a new group
    after = _stats(engine)
    assert after["digest"] == _digest(trained)
    assert after["inits"] == before["inits"] + 2


def test_a_refused_init_does_not_keep_the_trainer_waiting_for_the_group(engine: str) -> None:
    listening = _listening()
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as caught:
        with WeightSyncClient(engine, backend="broadcast", transport="nccl", timeout=60):
            pass
    assert time.monotonic() - start < 10
    assert (caught.value.status, caught.value.code) == (400, "unsupported")
    assert "transport nccl needs a CUDA engine" in caught.value.message
    assert _listening() == listening
