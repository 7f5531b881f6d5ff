"""`triode serve --headless`: a node other than the engine core's runs only its model workers.

Node `node_rank` of `nnodes` hosts ranks `node_rank * local .. (node_rank + 1) * local - 1`
(`local = world / nnodes`). They meet the others at the torch.distributed rendezvous (rank 0's
TCPStore at `--master-addr:--master-port`), read the executor's ZMQ addresses from that store
(sealed with the cluster key: `--cluster-key-file`, which every node shares), and take every
step's broadcast over ZMQ, CurveZMQ with that key. There is no node discovery of triode's own:
the addresses and ranks are the command line's, as with torchrun.

The process ends when its workers do: cleanly once the engine core broadcasts SHUTDOWN (or its
rank 0 disappears), with an error as soon as one of them dies, having killed the others.
"""

from __future__ import annotations

import logging
import os
import signal

import trio

from .config import EngineArgs
from .core.multiproc import WorkerGroup, worker_options
from .model_env import model_process_env

log = logging.getLogger(__name__)


async def serve_headless(
    args: EngineArgs, *, task_status: trio.TaskStatus[list[int]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run this node's workers until they exit; `task_status` gets their pids once all are
    READY. Raises `WorkerDied` (in an exception group) when one dies."""
    if args.node_rank == 0:
        raise ValueError("node 0 runs the engine core: start it without --headless")
    if args.master_port is None:
        raise ValueError("a headless node needs --master-addr and --master-port")
    local = args.world_size // args.nnodes
    ranks = list(range(args.node_rank * local, (args.node_rank + 1) * local))
    options = {rank: worker_options(args, rank, args.master_port) for rank in ranks}
    # what the engine core's environment gives its workers on node 0
    env = model_process_env(os.environ)
    group = WorkerGroup(ranks, clean_exit=True, env=env)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, group, nursery.cancel_scope)
        async with trio.open_nursery() as workers:
            group.start(workers, options)
            await group.ready.wait()
            log.info(
                "node %d of %d: ranks %d-%d ready, waiting for the engine core at %s:%d",
                args.node_rank,
                args.nnodes,
                ranks[0],
                ranks[-1],
                args.master_addr,
                args.master_port,
            )
            task_status.started(group.pids)
        nursery.cancel_scope.cancel()
    log.info("node %d: all workers ended", args.node_rank)


async def _stop_on_signals(group: WorkerGroup, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("%s: stopping this node's workers", signal.Signals(signum).name)
            group.stopping = True
            scope.cancel()
            return
