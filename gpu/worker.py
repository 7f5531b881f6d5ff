"""A model worker: one process per tensor x pipeline parallel rank.

The engine core's executor (or, on other nodes, `triode serve --headless`) starts it as a child
actor (`triode.gpu.worker:serve_worker`). It joins the torch.distributed world, loads its shard of
its pipeline stage, says READY with the KV block count every rank agreed on, and then runs the
step loop: each broadcast `SchedulerOutput` (from the shared-memory ring, or over ZMQ on a node
other than the engine core's) goes through `ModelRunner.execute` on every rank, and the driver
rank (TP rank 0 of the last stage) sends the `ModelRunnerOutput` back on a ZMQ PUSH socket.
In a world of several nodes those sockets are CurveZMQ clients with the cluster key, and a rank
on another node takes the executor's addresses from the rendezvous store only with the key's
seal on them.

The step loop runs in a thread, so the trio loop stays free to notice SHUTDOWN and a parent
that died while a collective blocks. A broadcast message that does not decode is counted and
skipped. Anything that goes wrong inside a step (a collective that timed out because a peer
died or hangs, a model error) ends the process with the error, which the supervisor turns into
the engine's failure: a rank that no longer steps in lockstep with the others cannot recover.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import msgspec
import torch
import trio
import zmq

from triode.wire import (
    Decoder,
    Encoder,
    ProtocolError,
    Ready,
    SchedulerOutput,
    WorkerCall,
    WorkerMessageType,
    WorkerReply,
)
from triode.wire.cluster_key import ClusterKey, apply_options
from triode.wire.operations import OperationError
from triode.wire.ring_wait import RingClosed, RingTimeout
from triode.wire.shm_ring import RingHandle, ShmRingReader

from . import parallel_state
from .operations import Operations
from .parallel_state import ParallelLayout
from .runners import open_runner

log = logging.getLogger(__name__)

# where rank 0 publishes the executor's addresses for ranks on other nodes
CLUSTER_KEY = "triode/cluster"
# how often an idle rank on another node checks that the world (rank 0's store) is still there
_IDLE_CHECK = 1.0
# how long a stopping worker waits for its step loop to finish before it exits without it
_CLOSE_WAIT = 1.0


class WorkerOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a worker is started with (the `options` of its CONFIG)."""

    engine_args: dict[str, Any]
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    collective_timeout: float
    # the executor's "ring" (a RingHandle) and "result" address: given to the ranks on the
    # engine core's node; the others read it from the rendezvous store
    cluster: dict[str, Any] | None = None
    device: str | None = None

    @property
    def local(self) -> bool:
        """On the engine core's node, which hosts ranks 0 .. local_world_size - 1."""
        return self.rank < self.local_world_size


class Worker:
    """One rank's model and its line to the executor; built in a thread (it blocks)."""

    def __init__(self, options: WorkerOptions, zmq_context: zmq.Context) -> None:
        self.options = options
        self.protocol_errors = 0
        self.steps = 0
        self.layout = ParallelLayout(
            options.tensor_parallel_size, options.pipeline_parallel_size, options.rank
        )
        local_world = options.local_world_size
        self.local_rank = options.rank % local_world
        self.device = torch.device(options.device or _default_device(options))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # a rank's threads: an equal share of the node's cores (binding each rank to its share
        # measured no faster on 2 cores, so the scheduler places them)
        cpus = parallel_state.cpu_share(self.local_rank, local_world)
        self.state = parallel_state.init_distributed(
            self.layout,
            master_addr=options.master_addr,
            master_port=options.master_port,
            device=self.device,
            collective_timeout=options.collective_timeout,
            # a node hosts consecutive ranks: a TP group shares a host when its size divides
            # the node's
            same_host_tp=local_world % options.tensor_parallel_size == 0,
            loopback=local_world == self.layout.world_size,
        )
        # several nodes: the executor's sockets are CurveZMQ, and its addresses in the store
        # are sealed, with the cluster's key (None on one node: nothing leaves the host)
        key_file = options.engine_args.get("cluster_key_file")
        self.key = ClusterKey.for_world(self.multi_node, key_file)
        client_options = self.key.client_options() if self.key is not None else []
        cluster = self._cluster()
        self.runner = open_runner(
            options.engine_args,
            device=str(self.device),
            num_threads=len(cpus),
        )
        self.operations = Operations(self.runner)
        # a ring's local readers are this node's ranks; the remote ones are numbered from 0
        # over the ranks of every other node
        self.remote = not options.local
        index = options.rank - options.local_world_size if self.remote else options.rank
        handle = msgspec.convert(cluster["ring"], RingHandle)
        self.reader = ShmRingReader(
            handle,
            index,
            zmq_context=zmq_context,
            remote=self.remote,
            socket_options=client_options,
        )
        self.result_address: str = cluster["result"]
        self.result_options = client_options
        self.zmq_context = zmq_context

    @property
    def multi_node(self) -> bool:
        return self.options.local_world_size < self.layout.world_size

    def _cluster(self) -> dict[str, Any]:
        """The executor's addresses: given to the engine core's node, shared through the
        rendezvous store with the others, sealed with the cluster key (the store takes any
        host's writes: a rank connects only where the engine core's node said)."""
        store = self.state.store
        assert store is not None
        if self.options.cluster is not None:
            if self.layout.rank == 0 and self.key is not None:
                value = json.dumps(self.options.cluster).encode()
                store.set(CLUSTER_KEY, self.key.seal(CLUSTER_KEY, value))
            return self.options.cluster
        if self.key is None:
            raise RuntimeError("a rank on another node has no cluster key")
        value = self.key.open(CLUSTER_KEY, store.get(CLUSTER_KEY))
        return msgspec.json.decode(value, type=dict[str, Any])

    def ready(self) -> Ready:
        runner = self.runner
        return Ready(
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            max_model_len=runner.max_model_len,
            info={
                "model_dir": str(runner.model_dir),
                "eos_token_id": runner.eos_token_id,
                "extra_eos_token_ids": runner.extra_eos_token_ids,
                "vocab_size": runner.vocab_size,
                "hidden_size": runner.hidden_size,
                "dtype": str(runner.dtype).removeprefix("torch."),
                "rank": self.layout.rank,
                "pid": os.getpid(),
                "kv_endpoints": runner.kv_endpoints,
                "pooling": None if runner.pooling_spec is None else runner.pooling_spec.as_dict(),
            },
        )

    def run(self, stop: threading.Event) -> None:
        """The step loop, until SHUTDOWN on the broadcast or `stop`. Blocks; run in a thread."""
        decoder = Decoder(SchedulerOutput)
        calls = Decoder(WorkerCall)
        encoder = Encoder()
        # every rank answers calls; only the driver answers steps
        results = self.zmq_context.socket(zmq.PUSH)
        apply_options(results, self.result_options)
        results.setsockopt(zmq.LINGER, 1000)
        results.setsockopt(zmq.SNDHWM, 0)
        results.connect(self.result_address)
        try:
            while not stop.is_set():
                try:
                    frames = self.reader.read(timeout=_IDLE_CHECK, cancelled=stop)
                except RingTimeout:
                    self._check_world()
                    continue
                except RingClosed:
                    return
                except ProtocolError as e:
                    self._protocol_error(e)
                    continue
                kind = bytes(frames[0]) if frames else b""
                if kind == WorkerMessageType.SHUTDOWN.value:
                    log.info("rank %d: shutdown after %d steps", self.layout.rank, self.steps)
                    return
                try:
                    if kind == WorkerMessageType.CALL.value:
                        reply = self.call(calls.decode(frames[1:]))
                        message = [WorkerMessageType.CALL.value, *encoder.encode(reply)]
                        results.send_multipart(message, copy=False)
                        continue
                    if kind != WorkerMessageType.EXECUTE.value:
                        raise ProtocolError(f"unknown worker message type {kind[:4]!r}")
                    sched = decoder.decode(frames[1:])
                except ProtocolError as e:
                    self._protocol_error(e)
                    continue
                output = self.runner.execute(sched)
                self.steps += 1
                if self.layout.is_driver:
                    output.protocol_errors = self.protocol_errors
                    results.send_multipart(encoder.encode(output), copy=False)
        finally:
            results.close()

    def call(self, call: WorkerCall) -> WorkerReply:
        """One of this rank's `Operations`, by name: its result, or how it failed."""
        reply = WorkerReply(call.call_id, self.layout.rank)
        try:
            reply.result = self.operations.call(call.method, call.kwargs)
        except OperationError as e:
            reply.error, reply.error_kind = e.message, e.kind
        except Exception as e:
            log.exception("rank %d: %s failed", self.layout.rank, call.method)
            reply.error = f"{type(e).__name__}: {e}"
        return reply

    def _protocol_error(self, error: ProtocolError) -> None:
        self.protocol_errors += 1
        rank = self.layout.rank
        log.warning("rank %d: dropped an undecodable broadcast message: %s", rank, error)

    def _check_world(self) -> None:
        """An idle rank on another node has no parent to watch: it leaves when rank 0's store,
        the world's rendezvous, is gone."""
        if not self.remote:
            return
        store = self.state.store
        assert store is not None
        try:
            store.check([CLUSTER_KEY])
        except Exception as e:
            raise RuntimeError(f"rank {self.layout.rank}: the world's rank 0 is gone ({e})") from e

    def close(self) -> None:
        self.operations.close()
        self.runner.shutdown()
        self.reader.close()
        parallel_state.destroy_distributed()


def _default_device(options: WorkerOptions) -> str:
    if torch.cuda.is_available():
        return f"cuda:{options.rank % options.local_world_size}"
    return "cpu"


async def serve_worker(ctx: Any) -> None:
    """The worker actor's entry (`triode.gpu.worker:serve_worker`); `ctx` is the child actor's
    context (`triode.actors.ChildContext`)."""
    options = msgspec.convert(ctx.options["worker"], WorkerOptions)
    started = time.perf_counter()
    worker = await trio.to_thread.run_sync(Worker, options, ctx.zmq_context, abandon_on_cancel=True)
    log.info(
        "rank %d of %d ready in %.1fs: %d KV blocks",
        options.rank,
        worker.layout.world_size,
        time.perf_counter() - started,
        worker.runner.num_kv_blocks,
    )
    stop, done = threading.Event(), threading.Event()

    def run() -> None:
        try:
            worker.run(stop)
        finally:
            done.set()

    try:
        await ctx.ready(worker.ready())
        # abandoned on cancellation: a thread blocked in a collective cannot be interrupted
        await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    finally:
        stop.set()  # a step loop between steps leaves at once
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(done.wait, _CLOSE_WAIT)
        # the groups are torn down only under a finished step loop, never under a collective
        if done.is_set():
            worker.close()
        else:
            # and without that teardown, the interpreter's exit can block in gloo's destructors
            # for good (seen: orphans whose parent had gone): leave without the interpreter's
            # own clean-up, which has nothing left to do for this process
            log.error("rank %d: the step loop is stuck in a step; exiting", options.rank)
            logging.shutdown()
            os._exit(1)
