"""Tensor and pipeline parallelism end to end on the default model: worker processes on gloo,
through the embedding API, `triode serve`, and two `triode serve` "nodes" on loopback.

Greedy float32 output must equal a world of one token for token (the world of one is pinned to
Hugging Face transformers by test_engine.py, so the reference here is transformers itself).
SmolLM2-135M has 9 query and 3 KV heads: over two ranks they split 6 + 3 and 2 + 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from processes import actor_processes, alive, descendants, on_every_interface
from reference import Reference
from server import free_port, running_server, stream_and_kill, wait_for_health

from triode.actors import SamplingParams, open_engine
from triode.actors.forkserver import ENV as FORKSERVER_ENV
from triode.actors.forkserver import Forkserver

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
F32 = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB"]


def alive_of(pids: list[int]) -> list[int]:
    return [pid for pid in pids if alive(pid)]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive_of(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive_of(pids)


@pytest.fixture(scope="module")
def expected(reference: Reference) -> list[list[int]]:
    return [reference.greedy(tuple(reference.encode(p)), NEW_TOKENS) for p in PROMPTS]


# TP=2 x PP=2 goes through `triode serve` below; tests/gpu/test_parallel.py runs every layout
# on tiny models
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
async def test_greedy_equals_a_world_of_one_through_the_embedding_api(
    model_dir: Path, reference: Reference, expected: list[list[int]], tp: int, pp: int
) -> None:
    results: dict[int, list[int]] = {}

    async def one(engine: object, i: int) -> None:
        async for out in engine.generate(reference.encode(PROMPTS[i]), GREEDY):  # type: ignore[attr-defined]
            results[i] = out.outputs[0].token_ids

    async with open_engine(
        str(model_dir),
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=1024,
        kv_cache_memory="256MiB",
    ) as engine:
        pids = engine.worker_pids
        assert len(pids) == tp * pp
        async with trio.open_nursery() as nursery:  # batched: one step carries all three
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, engine, i)
        stats = await engine.get_stats()
    assert [results[i] for i in range(len(PROMPTS))] == expected
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # two pipeline stages keep two micro-batches in flight
    assert (stats["overlapped_steps"] > 0) == (pp > 1)
    assert not wait_gone(pids, 2.0)


def _completions(url: str, reference: Reference) -> list[str]:
    texts = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        for prompt in PROMPTS:
            reply = client.completions.create(
                model=model,
                prompt=reference.encode(prompt),
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            texts.append(reply.choices[0].text)
    return texts


def test_serve_with_tp2_x_pp2_matches_and_leaves_no_process(
    model_dir: Path,
    reference: Reference,
    expected: list[list[int]],
    tmp_path: Path,
    forkserver: Forkserver,
) -> None:
    args = [*F32, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    with running_server(args, tmp_path / "serve.log") as server:
        found = actor_processes(server.process.pid, forkserver.pid)
        # the engine core and its four ranks
        assert sorted(found) == ["engine-core", "worker-0", "worker-1", "worker-2", "worker-3"]
        processes = [*descendants(server.process.pid), *found.values()]
        # the API, the rendezvous store, gloo and the ring's wake-ups: loopback only
        assert on_every_interface([server.process.pid, *processes]) == []
        texts = _completions(server.url, reference)
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
    assert texts == [reference.tokenizer.decode(e) for e in expected]
    assert server.process.returncode == 0
    assert not wait_gone(processes, 2.0)


def test_a_killed_worker_ends_the_stream_and_the_engine_core_starts_again(
    tmp_path: Path, forkserver: Forkserver, reference: Reference, expected: list[list[int]]
) -> None:
    args = ["--tensor-parallel-size", "2", "--max-model-len", "2048"]
    with running_server(args, tmp_path / "serve.log") as server:
        engine = server.engine_pid()
        # forked by the fork server, or executed by the server where the fork server declines
        workers = actor_processes(server.process.pid, forkserver.pid)
        assert workers.pop("engine-core") == engine
        assert sorted(workers) == ["worker-0", "worker-1"]
        events, ended = stream_and_kill(server, workers["worker-1"])
        assert ended < 2.0
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503
        # the engine core took the other rank down with it, and is gone itself
        assert not wait_gone([engine, *workers.values()], 2.0)
        # the log names the dead rank: as the engine core saw it die, or as rank 0 saw it gone
        # from the collective first (a fork server reports its child's death a little later)
        assert re.search(r"worker rank 1 died|rank 1 \(pid \d+\) is gone", server.output())
        # another engine core starts in its place, with ranks of its own, and serves
        wait_for_health(server.process, server.url, server.log, 120)
        server.restarted_engine_pid(1)
        again = actor_processes(server.process.pid, forkserver.pid)
        assert sorted(again) == ["engine-core", "worker-0", "worker-1"]
        assert not set(again.values()) & {engine, *workers.values()}
        assert _completions(server.url, reference) == [
            reference.tokenizer.decode(e) for e in expected
        ]


@pytest.fixture(scope="module")
def cluster_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A key file made as the README says, with `triode cluster-key`."""
    path = tmp_path_factory.mktemp("cluster") / "cluster.key"
    command = [sys.executable, "-m", "triode.edge.cli", "cluster-key", str(path)]
    subprocess.run(command, check=True, capture_output=True)
    assert path.stat().st_mode & 0o777 == 0o600
    return path


def two_nodes(key: Path, *args: str) -> list[str]:
    """The flags of a TP=2 world over two nodes on loopback, with a fresh master port."""
    return [*args, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()),
            "--cluster-key-file", str(key)]  # fmt: skip


@contextlib.contextmanager
def headless_node(world: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`triode serve --headless` as node 1 of `world`; killed on the way out if still up. Its
    rank runs below it (executed, not forked by the worker's fork server), as on a host of its
    own."""
    command = [sys.executable, "-m", "triode.edge.cli", "serve", "--headless", *world]
    env = {k: v for k, v in os.environ.items() if k != FORKSERVER_ENV}
    with log.open("wb") as out:
        node = subprocess.Popen(
            [*command, "--node-rank", "1"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        yield node
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def _executor_addresses(world: list[str], key: Path) -> dict[str, str]:
    """The engine core's broadcast and result addresses, as rank 0 published them in the
    rendezvous store: any host that reaches the store can read them, so they are no secret."""
    import datetime

    import torch.distributed as dist

    from triode.gpu.worker import CLUSTER_KEY
    from triode.wire.cluster_key import ClusterKey

    port = int(world[world.index("--master-port") + 1])
    store = dist.TCPStore("127.0.0.1", port, timeout=datetime.timedelta(seconds=10))
    cluster = json.loads(ClusterKey.load(key).open(CLUSTER_KEY, store.get(CLUSTER_KEY)))
    return {"ring": cluster["ring"]["overflow_address"], "result": cluster["result"]}


def test_two_nodes_on_loopback_match_a_world_of_one(
    model_dir: Path,
    reference: Reference,
    expected: list[list[int]],
    tmp_path: Path,
    cluster_key: Path,
    forkserver: Forkserver,
) -> None:
    import zmq

    world = two_nodes(cluster_key, *F32)
    with headless_node(world, tmp_path / "node1.log") as node1:
        node0 = [*world, "--node-rank", "0", "--enable-admin-api"]
        with running_server(node0, tmp_path / "node0.log") as server:
            remote = descendants(node1.pid)
            assert sorted(actor_processes(node1.pid)) == ["worker-1"]  # node 1 hosts rank 1
            local = actor_processes(server.process.pid, forkserver.pid)
            assert sorted(local) == ["engine-core", "worker-0"]  # node 0: the core and rank 0
            everyone = [
                server.process.pid, *descendants(server.process.pid), *local.values(),
                node1.pid, *remote,
            ]  # fmt: skip
            assert on_every_interface(everyone) == []  # the master address (here loopback) only
            # a host without the cluster key that found the executor's sockets: it hears no
            # step, and its garbage never reaches the engine core (whose driver's answers are
            # trusted: an undecodable one fails the engine)
            addresses = _executor_addresses(world, cluster_key)
            context = zmq.Context()
            listener = context.socket(zmq.SUB)
            listener.setsockopt(zmq.SUBSCRIBE, b"")
            listener.connect(addresses["ring"])
            intruder = context.socket(zmq.PUSH)
            intruder.setsockopt(zmq.SNDHWM, 1)
            intruder.connect(addresses["result"])
            for _ in range(3):
                with contextlib.suppress(zmq.Again):
                    intruder.send(b"\xc1 not a step's answer", zmq.NOBLOCK)
            texts = _completions(server.url, reference)
            heard = listener.poll(0)
            context.destroy(linger=0)
            # the administrative calls reach the rank on node 1 too, and it answers
            slept = httpx.post(f"{server.url}/sleep", params={"level": 2}, timeout=60)
            ranks = [p for p in slept.json()["processes"] if p["role"].startswith("rank-")]
            assert slept.status_code == 200 and len(ranks) == 2
            assert httpx.post(f"{server.url}/wake_up", timeout=60).status_code == 200
            assert _completions(server.url, reference) == texts
        assert texts == [reference.tokenizer.decode(e) for e in expected]
        assert not heard
        # the engine's SHUTDOWN reaches node 1's worker over ZMQ: that node ends by itself
        assert node1.wait(timeout=15) == 0, (tmp_path / "node1.log").read_text()
        assert not wait_gone(remote, 2.0)


def test_a_headless_node_ends_when_node_0_dies(tmp_path: Path, cluster_key: Path) -> None:
    world = two_nodes(cluster_key, "tiny-random")
    with headless_node(world, tmp_path / "node1.log") as node1:
        with running_server([*world, "--node-rank", "0"], tmp_path / "node0.log") as server:
            remote = list(actor_processes(node1.pid).values())
            os.kill(server.engine_pid(), signal.SIGKILL)
            killed = time.monotonic()
            # rank 0 goes with its engine core, and with it the rendezvous store: node 1's
            # idle worker sees the store gone within a second and the node fails
            assert node1.wait(timeout=10) != 0
            assert time.monotonic() - killed < 5
            assert not wait_gone(remote, 2.0)


def test_a_node_with_another_cluster_key_cannot_join(tmp_path: Path, cluster_key: Path) -> None:
    from triode.wire.cluster_key import ClusterKey

    other = tmp_path / "other.key"
    ClusterKey.generate().write(other)
    world = two_nodes(cluster_key, "tiny-random")
    stranger = [*world[: world.index("--cluster-key-file")], "--cluster-key-file", str(other)]
    with headless_node(stranger, tmp_path / "node1.log") as node1:
        with pytest.raises(RuntimeError, match="exited early"):
            with running_server([*world, "--node-rank", "0"], tmp_path / "node0.log"):
                pass
        # node 1 met the world at the store, found the executor's addresses sealed with
        # another key, and connected to nothing
        assert node1.wait(timeout=30) != 0
    assert "not sealed with this cluster's key" in (tmp_path / "node1.log").read_text()


def test_several_nodes_without_a_cluster_key_refuse_to_start() -> None:
    world = two_nodes(Path("unused"))[:-2]
    command = [sys.executable, "-m", "triode.edge.cli", "serve", *world]
    for node in (["--headless", "--node-rank", "1"], ["--node-rank", "0"]):
        done = subprocess.run([*command, *node], capture_output=True, text=True)
        assert done.returncode != 0
        [line] = done.stderr.strip().splitlines()
        assert line.endswith(
            "several nodes need --cluster-key-file: make one with `triode cluster-key PATH` "
            "and give every node the same file"
        )
