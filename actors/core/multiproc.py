"""The multiprocess executor: one model worker process per tensor x pipeline parallel rank.

The engine core starts this node's ranks as child actors (`triode.gpu.worker:serve_worker`,
through `open_child`: the same handshake, pidfd death detection and shutdown escalation as the
engine core itself); ranks on other nodes are started there by `triode serve --headless`
(`headless.py`) and meet this node's at the torch.distributed rendezvous (rank 0's TCPStore at
the master address). Each step's `SchedulerOutput` goes to every rank at once through a
shared-memory ring (`triode.wire.shm_ring`; messages larger than a chunk, and every message for
ranks on other nodes, over its ZMQ fallback), and the driver rank (TP rank 0 of the last stage)
answers on a ZMQ PULL socket. On one node both sockets are ipc:// in a private directory; with
several, they listen on the master address with CurveZMQ and the cluster key (`ClusterGate`
admits only its holders). This process never imports torch.

A worker that dies fails the engine at once: the world cannot step without every rank, so the
supervisor kills the other ranks (which would otherwise wait out their collective timeout) and
raises `WorkerDied`, which ends the engine core and so every request in flight. A rank that hangs
makes its peers' collectives time out after `distributed_timeout`; they exit with that error,
which is the same death.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import zmq

from triode.wire import (
    Decoder,
    Encoder,
    ModelRunnerOutput,
    ProtocolError,
    Ready,
    SchedulerOutput,
    Socket,
    WorkerCall,
    WorkerMessageType,
    WorkerReply,
)
from triode.wire.cluster_key import ClusterGate, ClusterKey
from triode.wire.operations import OPERATION_ERROR_KINDS, OperationError
from triode.wire.ports import free_port
from triode.wire.ring_wait import RingTimeout
from triode.wire.shm_ring import ShmRingWriter

from ..config import EngineArgs
from ..errors import ActorDied
from ..launcher import ready_timeout
from ..process import Child, open_child

if TYPE_CHECKING:
    from .executor import FillBitmask

log = logging.getLogger(__name__)

WORKER = "triode.gpu.worker:serve_worker"
SUBSCRIBE_TIMEOUT = 60.0  # for ranks on other nodes to connect to the broadcast


class WorkerDied(RuntimeError):
    """A model worker process died or failed; the engine cannot step without it."""


def worker_options(args: EngineArgs, rank: int, master_port: int, **extra: Any) -> dict[str, Any]:
    """The CONFIG options of rank `rank`'s worker (`triode.gpu.worker.WorkerOptions`)."""
    engine_args = msgspec.to_builtins(args)
    return {
        "worker": {
            "engine_args": engine_args,
            "rank": rank,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "local_world_size": args.world_size // args.nnodes,
            "master_addr": args.master_addr,
            "master_port": master_port,
            "collective_timeout": args.distributed_timeout,
            **extra,
        }
    }


class WorkerGroup:
    """Supervises one node's worker processes: starts them together (they rendezvous with each
    other, so none can be ready alone), and turns any death into `WorkerDied` after killing
    the rest."""

    def __init__(
        self,
        ranks: list[int],
        *,
        clean_exit: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`clean_exit`: a worker that exits with status 0 (after the engine's SHUTDOWN) has
        ended, not died (a headless node's workers). `env` adds to the workers' environment."""
        self.ranks = ranks
        self.clean_exit = clean_exit
        self.env = env
        self.children: dict[int, Child] = {}
        self.ready = trio.Event()
        self.stopping = False
        self.failed: int | None = None  # the first rank that died

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children.values()]

    def start(self, nursery: trio.Nursery, options: dict[int, dict[str, Any]]) -> None:
        for rank in self.ranks:
            nursery.start_soon(self._run, rank, options[rank])

    async def _run(self, rank: int, options: dict[str, Any]) -> None:
        try:
            async with open_child(
                WORKER,
                name=f"worker-{rank}",
                options=options,
                raise_on_death=False,
                ready_timeout=ready_timeout(),
                shutdown_timeout=2.0,
                terminate_timeout=1.0,
                env=self.env,
            ) as child:
                self.children[rank] = child
                if len(self.children) == len(self.ranks):
                    self.ready.set()
                await child.exited.wait()
                if self.stopping or (self.clean_exit and child.returncode == 0):
                    return
                if self.failed is not None:
                    return  # killed because rank `failed` died: that one reports
                self.failed = rank
                self.kill_all()
                raise WorkerDied(f"model worker rank {rank} died: {child.error}") from child.error
        except* ActorDied as group:
            # it died before READY; the other ranks would wait for it at the rendezvous
            self.kill_all()
            [error] = group.exceptions[:1]
            raise WorkerDied(f"model worker rank {rank} failed to start: {error}") from error

    def kill_all(self) -> None:
        """SIGKILL every rank of this node still running: processes this group started."""
        for child in self.children.values():
            if child.alive:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class MultiprocExecutor:
    """The engine core's side of the workers: broadcast a step, await the driver's answer."""

    def __init__(
        self,
        ring: ShmRingWriter,
        results: Socket,
        group: WorkerGroup,
        ready: Ready,
        max_concurrent_batches: int = 1,
        world_size: int = 1,
    ) -> None:
        self.max_concurrent_batches = max_concurrent_batches
        self.world_size = world_size  # every rank answers a call, on any node
        self._call_ids = itertools.count()
        # one call at a time: the administrative operations' and the LoRA adapters' calls
        # come from tasks of their own, and the replies of two would interleave
        self._calling = trio.Lock()
        self._reply_decoder = Decoder(WorkerReply)
        self._ring = ring
        self._results = results
        self._encoder = Encoder()
        self._decoder = Decoder(ModelRunnerOutput)
        self.group = group
        self.protocol_errors = 0
        self.num_kv_blocks = ready.num_kv_blocks
        self.block_size = ready.block_size
        self.max_model_len = ready.max_model_len
        info = ready.info
        self.model_dir = Path(info["model_dir"])
        self.eos_token_id: int | None = info.get("eos_token_id")
        self.extra_eos_token_ids: list[int] = list(info.get("extra_eos_token_ids") or [])
        self.vocab_size: int = info["vocab_size"]
        self.hidden_size: int = info.get("hidden_size", 0)
        self.dtype: str = info.get("dtype", "")
        self.kv_endpoints: list[str] = list(info.get("kv_endpoints") or [])
        self.pooling: dict[str, Any] | None = info.get("pooling")
        self.is_encoder = False  # encoders run in the engine core's process only

    @property
    def worker_pids(self) -> list[int]:
        """This node's worker processes."""
        return self.group.pids

    async def execute(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> ModelRunnerOutput:
        await self.submit(scheduler_output, fill_bitmask)
        return await self.receive(scheduler_output)

    async def submit(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> None:
        if fill_bitmask is not None and scheduler_output.grammar_request_ids:
            # the bitmask travels in the step's broadcast, so it is filled first
            await trio.to_thread.run_sync(fill_bitmask, scheduler_output)
        frames = self._encoder.encode(scheduler_output)
        await self.broadcast([WorkerMessageType.EXECUTE.value, *frames])

    async def receive(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The driver answers steps in the order they were broadcast: every stage takes them
        in that order."""
        reply = await self._results.recv_multipart()
        if reply[0].buffer == WorkerMessageType.CALL.value:
            raise WorkerDied("a rank answered a call while a step was in flight")
        try:
            output = self._decoder.decode([f.buffer for f in reply])
        except ProtocolError as e:
            # our own driver rank: a reply we cannot read means the ranks are out of step
            raise WorkerDied(f"the driver rank answered with an undecodable message: {e}") from e
        if output.step != scheduler_output.step:
            raise WorkerDied(
                f"the driver rank answered step {output.step} to step {scheduler_output.step}"
            )
        self.protocol_errors = output.protocol_errors
        return output

    async def call_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Broadcast the call; every rank answers on the results socket (the engine core
        makes calls only with no step in flight, so no step's answer is among them). Calls
        wait for each other's end."""
        async with self._calling:
            return await self._call_workers(method, kwargs)

    async def _call_workers(self, method: str, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        call_id = next(self._call_ids)
        frames = self._encoder.encode(WorkerCall(call_id, method, kwargs))
        await self.broadcast([WorkerMessageType.CALL.value, *frames])
        replies: dict[int, WorkerReply] = {}
        while len(replies) < self.world_size:
            message = await self._results.recv_multipart()
            if message[0].buffer != WorkerMessageType.CALL.value:
                raise WorkerDied("the driver rank answered a step during a call")
            try:
                reply = self._reply_decoder.decode([f.buffer for f in message[1:]])
            except ProtocolError as e:
                raise WorkerDied(f"a rank answered a call undecodably: {e}") from e
            if reply.call_id == call_id:  # else the late answer to a call cancelled before
                replies[reply.rank] = reply
        failed = [r for r in replies.values() if r.error is not None]
        if failed:
            first = min(failed, key=lambda r: r.rank)
            assert first.error is not None
            if first.error_kind in OPERATION_ERROR_KINDS:
                raise OperationError(first.error_kind, first.error)  # type: ignore[arg-type]
            raise RuntimeError(f"rank {first.rank}: {first.error}")
        return [replies[rank].result for rank in sorted(replies)]

    async def broadcast(self, frames: list[Any]) -> None:
        """Put one message on the ring for every rank. Only when the slowest reader still
        holds the oldest chunk does this wait, in a thread."""
        try:
            self._ring.write(frames, timeout=0)
        except RingTimeout:
            await trio.to_thread.run_sync(self._write_blocking, frames, abandon_on_cancel=True)

    def _write_blocking(self, frames: list[Any]) -> None:
        while not self.group.stopping:
            try:
                self._ring.write(frames, timeout=1.0)
                return
            except RingTimeout:
                continue


@asynccontextmanager
async def open_multiproc_executor(args: EngineArgs) -> AsyncIterator[MultiprocExecutor]:
    """Start this node's ranks and yield the executor once every rank is READY. Leaving the
    block broadcasts SHUTDOWN and stops the workers (SHUTDOWN message, deadline, signals)."""
    world, local = args.world_size, args.world_size // args.nnodes
    multi_node = args.nnodes > 1
    # one node's rendezvous is on loopback, whatever --master-addr says (the workers' too)
    host = args.master_addr if multi_node else "127.0.0.1"
    master_port = args.master_port or free_port(host)
    key = ClusterKey.for_world(multi_node, args.cluster_key_file)
    group = WorkerGroup(list(range(local)))
    with contextlib.ExitStack() as resources:
        tmpdir = tempfile.mkdtemp(prefix="triode-workers-")
        resources.callback(shutil.rmtree, tmpdir, ignore_errors=True)
        zctx = zmq.Context()
        resources.callback(zctx.term)
        # ranks on other nodes reach the broadcast and the results over TCP at the master
        # address, through CurveZMQ with the cluster's key; the gate turns away the rest
        server_options = []
        if key is not None:
            gate = ClusterGate(zctx, key)
            resources.callback(_close_gate, gate)
            server_options = key.server_options()
        overflow = f"tcp://{_zmq_host(host)}:*" if multi_node else f"ipc://{tmpdir}/broadcast"
        ring = ShmRingWriter(
            local,
            zmq_context=zctx,
            overflow_address=overflow,
            remote_readers=world - local,
            socket_options=server_options,
        )
        resources.callback(ring.close)
        results_bind = f"tcp://{_zmq_host(host)}:*" if multi_node else f"ipc://{tmpdir}/results"
        results = Socket.open(zctx, zmq.PULL, bind=results_bind, options=server_options)
        resources.callback(results.close)
        resources.callback(group.kill_all)
        cluster = {"ring": msgspec.to_builtins(ring.handle), "result": results.last_endpoint}
        options = {
            rank: worker_options(args, rank, master_port, cluster=cluster) for rank in range(local)
        }
        async with trio.open_nursery() as nursery:
            group.start(nursery, options)
            await group.ready.wait()
            if world > local:
                log.info("waiting for %d ranks on other nodes", world - local)
                await trio.to_thread.run_sync(
                    ring.wait_for_subscribers, SUBSCRIBE_TIMEOUT, abandon_on_cancel=True
                )
            first = group.children[0].ready
            assert first is not None
            executor = MultiprocExecutor(
                ring,
                results,
                group,
                first,
                max_concurrent_batches=args.pipeline_parallel_size,
                world_size=world,
            )
            log.info(
                "%d model workers ready (tensor parallel %d x pipeline parallel %d, %d nodes)",
                world,
                args.tensor_parallel_size,
                args.pipeline_parallel_size,
                args.nnodes,
            )
            try:
                yield executor
            finally:
                group.stopping = True
                with trio.move_on_after(1.0) as scope:
                    scope.shield = True
                    await executor.broadcast([WorkerMessageType.SHUTDOWN.value])
                nursery.cancel_scope.cancel()


def _close_gate(gate: ClusterGate) -> None:
    if gate.refused:
        log.warning("turned away %d connections without the cluster key", gate.refused)
    gate.close()


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
