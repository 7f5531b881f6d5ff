"""This process's place in a tensor x pipeline parallel world, and its torch.distributed groups.

Ranks are laid out as vLLM lays them out: `rank = pp_rank * tp_size + tp_rank`, so the ranks of
one pipeline stage are consecutive (one tensor-parallel group per stage) and a pipeline group
holds the ranks with the same tensor-parallel rank. A node hosts `world_size // nnodes`
consecutive ranks.

Rendezvous is a `torch.distributed.TCPStore` hosted by global rank 0 at the master address; the
store listens on that address only (torch's own binds every interface), and a world on one node
keeps its store, and gloo's (or NCCL's bootstrap) sockets, on the loopback interface. The
default group (gloo on CPU, nccl on CUDA) keeps a long timeout for start-up, where ranks wait
for each other's model loading, and the tensor- and pipeline-parallel groups that the forward
pass uses get `collective_timeout`, so a rank that hangs mid-step fails the others within it.
A process that is not a worker (the engine core running the model in-process, a test) is rank 0
of a world of one, with no groups.

On the CPU, a tensor-parallel group whose ranks share a host also gets a `ShmAllReduce`, which
`tp_all_reduce` uses for the small sums of every layer (gloo's all-reduce costs ~2 ms there);
`TRIODE_SHM_ALLREDUCE=0` turns it off.

Expert parallelism adds no group: a mixture-of-experts block built under `expert_parallel`
splits its experts over the TP group's ranks and exchanges within that group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import object_collectives
from .shm_allreduce import ShmAllReduce, ShmUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

STARTUP_TIMEOUT = 900.0  # seconds for every rank to join and load its shard
LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"  # Linux's name for it


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and this process's coordinates; pure arithmetic, no torch.distributed."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor- and pipeline-parallel sizes must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples and answers the engine core: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def driver_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        return [pp_rank * self.tp_size + t for t in range(self.tp_size)]

    def pp_group_ranks(self, tp_rank: int) -> list[int]:
        return [p * self.tp_size + tp_rank for p in range(self.pp_size)]

    @property
    def prev_rank(self) -> int:
        """The same TP rank of the previous stage (what this stage receives from)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size


@dataclass
class ParallelState:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    store: dist.Store | None = None
    tp_shm: ShmAllReduce | None = None


_state = ParallelState()


def get() -> ParallelState:
    return _state


def layout() -> ParallelLayout:
    return _state.layout


def partition(total: int, parts: int, *, allow_empty: bool = False) -> list[tuple[int, int]]:
    """`total` items cut into `parts` contiguous (start, count) ranges whose counts differ by at
    most one, the larger ones first; some are empty where `allow_empty` lets `total` be fewer
    than `parts` (a step's tokens over the ranks)."""
    if parts < 1 or (total < parts and not allow_empty):
        raise ValueError(f"cannot split {total} into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        count = base + (i < extra)
        ranges.append((start, count))
        start += count
    return ranges


@dataclass
class _ExpertParallel:
    enabled: bool = False
    asked: bool = False  # whether a model built under the setting read it


_expert_parallel = _ExpertParallel()


@contextlib.contextmanager
def expert_parallel(enabled: bool) -> Iterator[None]:
    """Build models with `enabled` expert parallelism (`--enable-expert-parallel`): each
    mixture-of-experts block then holds whole experts, its share of them over this stage's TP
    group, instead of every expert's share of the intermediate dimension. A model built under
    it that never asks (one without experts) runs as it would without, as vLLM's do; the log
    says so."""
    global _expert_parallel
    previous, _expert_parallel = _expert_parallel, _ExpertParallel(enabled)
    try:
        yield
        if enabled and not _expert_parallel.asked:
            log.info("expert parallelism asked for a model without experts: ignored")
    finally:
        _expert_parallel = previous


def expert_parallel_enabled() -> bool:
    """Whether a mixture-of-experts block built now splits its experts over the TP group."""
    _expert_parallel.asked = True
    return _expert_parallel.enabled


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    parallel: ParallelLayout,
    *,
    master_addr: str,
    master_port: int,
    device: torch.device,
    collective_timeout: float,
    startup_timeout: float = STARTUP_TIMEOUT,
    shm_all_reduce_bytes: int = 1 << 20,
    same_host_tp: bool | None = None,
    loopback: bool = False,
) -> ParallelState:
    """Join the world: the TCPStore rendezvous, the default group, then every TP and PP group
    (each rank creates every group, in the same order, as torch.distributed requires).

    `loopback` (a world on one node): the store binds 127.0.0.1, whatever `master_addr` says,
    and the collectives' sockets use the loopback interface, so no other host reaches them.

    On the CPU, a TP group of two or more ranks then sets up a shared-memory all-reduce for
    tensors of up to `shm_all_reduce_bytes` as float32 (0: none). `same_host_tp` says whether
    this group's ranks share a host (`local_world_size % tp_size == 0`, as a node hosts
    consecutive ranks); None tries, and falls back to gloo quietly when they do not. Every rank
    of a group must pass the same values."""
    global _state
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    startup = datetime.timedelta(seconds=startup_timeout)
    if loopback:
        master_addr = LOOPBACK
        # read when each gloo group (and NCCL's bootstrap) picks its interface
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ[variable] = LOOPBACK_INTERFACE
    listen_fd = _listen(master_addr, master_port) if parallel.rank == 0 else None
    store = dist.TCPStore(
        master_addr,
        master_port,
        parallel.world_size,
        is_master=parallel.rank == 0,
        timeout=startup,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )
    backend = backend_for(device)
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=parallel.rank,
        world_size=parallel.world_size,
        timeout=startup,
        **extra,
    )
    _state = _with_groups(parallel, backend, collective_timeout, store)
    _add_shm_all_reduce(_state, device, collective_timeout, shm_all_reduce_bytes, same_host_tp)
    return _state


def _listen(host: str, port: int) -> int:
    """A socket listening on `host`:`port` only, for the store (which owns it from then on)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV
    )[0]
    with socket.socket(family, kind, proto) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        return listener.detach()


def _add_shm_all_reduce(
    state: ParallelState,
    device: torch.device,
    timeout: float,
    max_bytes: int,
    same_host_tp: bool | None,
) -> None:
    parallel = state.layout
    if (
        device.type != "cpu"
        or parallel.tp_size == 1
        or max_bytes <= 0
        or same_host_tp is False
        or os.environ.get("TRIODE_SHM_ALLREDUCE", "1") == "0"
    ):
        return
    assert state.tp_group is not None
    try:
        state.tp_shm = ShmAllReduce.create(state.tp_group, max_bytes=max_bytes, timeout=timeout)
    except ShmUnavailable as e:
        level = logging.WARNING if same_host_tp else logging.INFO
        log.log(level, "rank %d: tensor-parallel sums stay on gloo: %s", parallel.rank, e)


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over this rank's TP group, in place, and return it: through shared memory
    when the group has it and the tensor fits, else `dist.all_reduce`. Every rank of the group
    makes the same choice, as it depends only on the shape, dtype and device they share."""
    shm = _state.tp_shm
    if shm is not None and shm.fits(tensor):
        shm.all_reduce(tensor)
    else:
        dist.all_reduce(tensor, group=_state.tp_group)
    return tensor


def recv_from_previous_stage(
    rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous pipeline stage's output, from the same TP rank there: the hidden states
    ([rows, hidden_size] of `dtype`) and the float32 residual."""
    stage, group = _state.layout, _state.pp_group
    hidden = torch.empty(rows, hidden_size, dtype=dtype, device=device)
    residual = torch.empty(rows, hidden_size, dtype=torch.float32, device=device)
    dist.recv(hidden, src=stage.prev_rank, group=group)
    dist.recv(residual, src=stage.prev_rank, group=group)
    return hidden, residual


def send_to_next_stage(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """This stage's output (`recv_from_previous_stage`) to the same TP rank of the next stage."""
    stage, group = _state.layout, _state.pp_group
    dist.send(hidden.contiguous(), dst=stage.next_rank, group=group)
    dist.send(residual.contiguous(), dst=stage.next_rank, group=group)


def init_groups(
    parallel: ParallelLayout,
    *,
    collective_timeout: float,
    device: torch.device,
    shm_all_reduce_bytes: int = 1 << 20,
) -> ParallelState:
    """Every TP and PP group (and the CPU's shared-memory all-reduce, as `init_distributed`
    sets up) over a default group that is already initialised (by `local_group.run_ranks`,
    say) with `parallel`'s rank and world size, its ranks on one host. There is no store;
    destroying the default group, as its owner does, destroys these groups too; call
    `destroy_distributed` first to release the shared memory."""
    global _state
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised in this process")
    joined = (dist.get_rank(), dist.get_world_size())
    if joined != (parallel.rank, parallel.world_size):
        raise ValueError(f"the default group has rank {joined[0]} of {joined[1]}, not {parallel}")
    _state = _with_groups(parallel, dist.get_backend(), collective_timeout, None)
    _add_shm_all_reduce(_state, device, collective_timeout, shm_all_reduce_bytes, True)
    return _state


def _with_groups(
    parallel: ParallelLayout, backend: str, collective_timeout: float, store: dist.Store | None
) -> ParallelState:
    step = datetime.timedelta(seconds=collective_timeout)
    tp_group = pp_group = None
    for pp_rank in range(parallel.pp_size):
        group = dist.new_group(parallel.tp_group_ranks(pp_rank), timeout=step, backend=backend)
        if pp_rank == parallel.pp_rank:
            tp_group = group
    for tp_rank in range(parallel.tp_size):
        group = dist.new_group(parallel.pp_group_ranks(tp_rank), timeout=step, backend=backend)
        if tp_rank == parallel.tp_rank:
            pp_group = group
    return ParallelState(parallel, tp_group, pp_group, store)


def destroy_distributed() -> None:
    global _state
    if _state.tp_shm is not None:
        _state.tp_shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def world_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value`; `value` itself outside a parallel world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    count = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


def all_gather(value: T, type: type[T] | Any) -> list[T]:
    """Every rank's `value` (msgpack, decoded as `type`: no pickle between ranks), in rank
    order; `[value]` outside a parallel world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    return object_collectives.all_gather(value, type)


def cpu_share(local_rank: int, local_world_size: int) -> list[int]:
    """The CPUs of a node's rank: an equal, contiguous share of those this process may run on
    (all of them where there are fewer CPUs than ranks)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = len(cpus) // max(1, local_world_size)
    if per_rank == 0:
        return cpus
    return cpus[local_rank * per_rank : (local_rank + 1) * per_rank]
