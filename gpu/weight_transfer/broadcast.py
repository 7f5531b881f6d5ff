"""The broadcast backend's group: the trainer is rank 0, engine rank r of engine core e is
`1 + e * ranks_per_engine + r`, and weights travel as broadcasts from rank 0.

The group stands apart from the default process group, which the workers keep for their own
tensor and pipeline parallelism: it is built from torch.distributed's classes directly (a
`TCPStore` the trainer hosts, a `PrefixStore`, then `ProcessGroupGloo` or `ProcessGroupNCCL`)
and used through the backend's own `broadcast`, so nothing registers it as a world.

Joining: each engine rank counts itself in on the trainer's store before it builds the group,
so the trainer, which must build it too, waits only as long as ranks keep arriving and can give
up at once when the server refuses the `init` call (the `abandoned` callbacks). A broadcast's
sender waits for its receivers, so a trainer whose `/update_weights` the server refused before
the ranks received sees its broadcast stall, gives up the same way (after `ABANDON_GRACE`), and
closes the group; a rank that closes its end makes the trainer's pending broadcast fail at once
(the peer is gone). Neither side waits out the timeout for a failure the other knows of.

Gloo's sockets bind the address that routes to the trainer (on the trainer, `master_address`
itself), whatever `GLOO_SOCKET_IFNAME` says for the workers' own groups.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from triode.wire.operations import OperationError
from triode.wire.weight_update import BroadcastInit, BroadcastUpdate, decode_init_info, tensor_bytes

from ..parallel_state import _listen, backend_for

log = logging.getLogger(__name__)

PREFIX = "triode_weights/"
# seconds a broadcast may take to complete once the server has answered (see TrainerGroup.send)
ABANDON_GRACE = 2.0
_ARRIVED = "arrived"
_HELLO = 0x74726F64  # the handshake broadcast's second value


class Abandoned(Exception):
    """The trainer stopped waiting on the group because the server already answered."""


class _Group:
    def __init__(
        self,
        pg: Any,
        store: Any,
        *,
        rank: int,
        size: int,
        transport: str,
        device: torch.device,
    ) -> None:
        self.rank = rank
        self.size = size
        self.transport = transport
        # where the broadcasts' buffers live: gloo moves CPU tensors, nccl the device's
        self.device = device if transport == "nccl" else torch.device("cpu")
        self._pg: Any = pg
        self._store: Any = store

    @property
    def closed(self) -> bool:
        return self._pg is None

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        if self._pg is None:
            raise RuntimeError("the weight transfer group is closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        return self._pg.broadcast([tensor], options)

    def _hello(self, check: bool) -> None:
        hello = torch.tensor([self.size, _HELLO], dtype=torch.int64, device=self.device)
        self._broadcast(hello).wait()
        if check and hello.tolist() != [self.size, _HELLO]:
            raise ValueError(f"the trainer's group is not of {self.size} ranks: {hello.tolist()}")

    def close(self) -> None:
        """Tear the group down (its peers' pending broadcasts fail at once). Idempotent."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as e:  # a group that failed may refuse to shut down cleanly
                log.debug("weight transfer group %d/%d: shutdown: %s", self.rank, self.size, e)


class BroadcastGroup(_Group):
    """An engine rank's end of the group: joins as `rank` on `device` (the rank's model's) at
    construction, then receives the trainer's broadcasts.

    Construction raises OperationError: "invalid" when `init_info` is wrong or the trainer
    cannot be joined within its timeout, "unsupported" for nccl off a CUDA device."""

    def __init__(
        self, init_info: BroadcastInit | Mapping[str, Any], rank: int, device: torch.device
    ) -> None:
        init = init_info if isinstance(init_info, BroadcastInit) else decode_init_info(init_info)
        if not isinstance(init, BroadcastInit):
            raise OperationError("invalid", "init_info: not the broadcast backend's")
        if not 0 < rank < init.world_size:
            raise OperationError(
                "invalid",
                f"init_info: world_size {init.world_size} leaves no rank {rank} for this engine",
            )
        transport = init.transport or backend_for(device)
        if transport == "nccl" and (device.type != "cuda" or not hasattr(dist, "ProcessGroupNCCL")):
            raise OperationError(
                "unsupported", f"transport nccl needs a CUDA engine; this one runs on {device.type}"
            )
        timeout = datetime.timedelta(seconds=init.timeout)
        where = f"{init.master_address}:{init.master_port}"
        try:
            local = _address_towards(init.master_address, init.master_port)
            store = dist.TCPStore(
                init.master_address, init.master_port, is_master=False, timeout=timeout
            )
            prefixed = dist.PrefixStore(PREFIX, store)
            prefixed.add(_ARRIVED, 1)
            pg = _process_group(prefixed, rank, init.world_size, transport, timeout, local)
        except Exception as e:
            raise OperationError(
                "invalid", f"cannot join the trainer's group at {where}: {e}"[:1000]
            ) from None
        super().__init__(
            pg, store, rank=rank, size=init.world_size, transport=transport, device=device
        )
        try:
            self._hello(check=True)
        except Exception as e:
            self.close()
            raise OperationError("invalid", f"the trainer's group at {where}: {e}") from None

    def receive(self, update: BroadcastUpdate) -> list[tuple[str, torch.Tensor]]:
        """The update's tensors, full, in order, each received into a buffer of its announced
        dtype and shape as it comes (so memory grows only with what the trainer sends).

        A failed broadcast (the trainer went away, sent something else, or timed out) closes
        the group and raises OperationError("invalid")."""
        received: list[tuple[str, torch.Tensor]] = []
        for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._receive(name, tensor)
            received.append((name, tensor))
        return received

    def drain(self, update: BroadcastUpdate) -> None:
        """Receive and drop the update's tensors, through one buffer as large as the largest,
        so the trainer's broadcasts complete though the engine refuses them. Fails as `receive`.
        """
        sizes = [tensor_bytes(d, s) for d, s in zip(update.dtype_names, update.shapes, strict=True)]
        scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=self.device)
        for name, dtype, shape, size in zip(
            update.names, update.dtype_names, update.shapes, sizes, strict=True
        ):
            self._receive(name, scratch[:size].view(getattr(torch, dtype)).view(shape))

    def _receive(self, name: str, tensor: torch.Tensor) -> None:
        try:
            self._broadcast(tensor).wait()
        except Exception as e:
            self.close()
            raise OperationError(
                "invalid", f"receiving {name} failed, and the group is closed: {e}"[:1000]
            ) from None


class Rendezvous:
    """Where the trainer's group forms: its store, listening at `master_address`:`master_port`
    from construction (OSError when the port is taken), so the engines can be told of it."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        transport: str,
        timeout: float,
    ) -> None:
        self.address = master_address
        self.world_size = world_size
        self.transport = transport
        self.timeout = timeout
        self._store: Any = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=_listen(master_address, master_port),
        )
        self._prefixed: Any = dist.PrefixStore(PREFIX, self._store)

    def join(self, abandoned: Callable[[], bool] = lambda: False) -> TrainerGroup:
        """Wait for the other `world_size - 1` ranks to arrive and build the group with them,
        as rank 0. Raises Abandoned when `abandoned()` turns true first, TimeoutError when they
        do not all arrive within `timeout` seconds, what the backend raises when the group
        cannot form."""
        # No local names the store: a traceback keeps this frame, and the store would listen on.
        if self._store is None:
            raise RuntimeError("the rendezvous is closed")
        deadline = time.monotonic() + self.timeout
        pause = 1e-3
        while (arrived := self._prefixed.add(_ARRIVED, 0)) < self.world_size - 1:
            if abandoned():
                raise Abandoned
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{arrived} of {self.world_size - 1} engine ranks joined within "
                    f"{self.timeout} s"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        if self.transport == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        delta = datetime.timedelta(seconds=self.timeout)
        group = TrainerGroup(
            _process_group(self._prefixed, 0, self.world_size, self.transport, delta, self.address),
            self._store,
            rank=0,
            size=self.world_size,
            transport=self.transport,
            device=device,
        )
        try:
            group._hello(check=False)
        except BaseException:
            group.close()
            raise
        return group

    def close(self) -> None:
        """Let go of the store: it stops listening once no group holds it (a joined group
        keeps it until it closes). Idempotent."""
        self._store = self._prefixed = None


class TrainerGroup(_Group):
    """The trainer's end, rank 0, from `Rendezvous.join`."""

    def send(self, tensors: Sequence[torch.Tensor], *, abandoned: Callable[[], bool]) -> None:
        """Broadcast `tensors` in order (each copied to the transport's device first where it is
        elsewhere). `abandoned()` turns true when the server has answered with a refusal: the
        broadcast under way then has `ABANDON_GRACE` seconds to complete (the engine may have
        received it just before answering), and none starts after it. Raises Abandoned when one
        did not complete, and what the backend raises when a broadcast fails; either way the
        group is out of step with the engine's (close it)."""
        for tensor in tensors:
            if abandoned():
                raise Abandoned
            work = self._broadcast(tensor.detach().to(self.device).contiguous())
            try:
                pause, deadline = 1e-4, math.inf
                while not work.is_completed():
                    if deadline == math.inf and abandoned():
                        deadline = time.monotonic() + ABANDON_GRACE
                    if time.monotonic() > deadline:
                        raise Abandoned
                    time.sleep(pause)
                    pause = min(2 * pause, 0.01)
                work.wait()  # raises what the broadcast failed with
            finally:
                del work  # it holds the group, and a traceback would keep it (and its sockets)


def _process_group(
    store: Any,
    rank: int,
    size: int,
    transport: str,
    timeout: datetime.timedelta,
    local_address: str,
) -> Any:
    """A process group of `size` over `store`, not registered with torch.distributed."""
    if transport == "nccl":
        nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])
