"""What the tests ask of processes they started: whether one still runs, which actors run
below it, and what sockets it holds; and a pool of rank processes that runs one world after
another."""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any


class RankPool:
    """Spawned processes that run worlds of ranks one after another: each `run` hands every
    rank to a process of its own (the pool has at least as many processes as the largest world,
    and runs one world at a time), so that a module's worlds pay for starting Python and torch
    once, not once per rank of each world. A rank that raises ends the world's distributed
    state in its process before the next world starts there."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pool = ProcessPoolExecutor(size, mp_context=multiprocessing.get_context("spawn"))

    def run(self, target: Callable[..., Any], args_of_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`target(*args)` for every entry of `args_of_rank`, all at once; their results in
        order. Each must return within 240 s; otherwise the pool is ended and this raises."""
        assert len(args_of_rank) <= self.size, (len(args_of_rank), self.size)
        futures = [self._pool.submit(_in_world, target, args) for args in args_of_rank]
        _, late = wait(futures, timeout=240)
        if late:
            self.close(kill=True)
            raise TimeoutError(f"{len(late)} of {len(futures)} ranks still ran after 240 s")
        return [f.result() for f in futures]

    def close(self, *, kill: bool = False) -> None:
        """End every process of the pool (`kill`: at once); none may outlive the call."""
        processes = list((self._pool._processes or {}).values())  # type: ignore[attr-defined]
        if kill:
            for process in processes:
                process.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for process in processes:
            process.join()
        assert not any(alive(process.pid) for process in processes)


def join_cpu_world(layout: Any, port: int) -> None:
    """This process's rank of `layout` in a gloo world on loopback at `port`, on one thread
    (the ranks of a world share the machine's cores)."""
    # torch and triode's model side, only in the rank processes that join a world
    import torch

    from triode.gpu import parallel_state

    torch.set_num_threads(1)
    parallel_state.init_distributed(
        layout,
        master_addr="127.0.0.1",
        master_port=port,
        device=torch.device("cpu"),
        collective_timeout=60,
    )


def _in_world(target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    try:
        return target(*args)
    finally:
        import torch.distributed as dist

        from triode.gpu import parallel_state

        if dist.is_initialized():
            parallel_state.destroy_distributed()


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie is gone for every purpose but its exit status."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children found through each of its threads."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def actor_processes(*roots: int) -> dict[str, int]:
    """The live triode actors below `roots`, by actor name (`engine-core`, `worker-1`,
    `api-server-0`: each names its process so, `/proc/PID/comm`). An actor forked by the
    worker's fork server is that server's child, not its starter's: a test passes the fork
    server among `roots` (each worker runs one test at a time, so its fork server's actors are
    the test's). Not, say, multiprocessing's resource tracker, which a server starts too."""
    found = {}
    for pid in {p for root in roots for p in descendants(root)}:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if _ACTOR_NAME.fullmatch(name) and alive(pid):
            found[name] = pid
    return found


_ACTOR_NAME = re.compile(r"(engine-core|worker|api-server)(-\d+)?")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return inodes
    for fd in fds:
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> tuple[str, int]:
    """/proc/net's `0100007F:1F90` (IPv4) or 32 hex digits (IPv6, in 32-bit words of host
    order): the address as text, and the port."""
    import ipaddress
    import socket

    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return str(ipaddress.ip_address(socket.inet_ntop(family, words))), int(port, 16)


def _owned_rows(pid: int, tables: Sequence[str]) -> Iterator[tuple[str, list[str]]]:
    """(table, fields) of every row of /proc/PID/net/TABLE whose socket `pid` holds."""
    inodes = _socket_inodes(pid)
    for table in tables:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                yield table, fields


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, protocol, address, port) of every TCP socket listening and every UDP socket bound
    by one of `pids`, from the kernel's socket tables (what `ss -ltnu` shows)."""
    found = []
    for pid in pids:
        for table, fields in _owned_rows(pid, ("tcp", "tcp6", "udp", "udp6")):
            if fields[3] == "0A" or not table.startswith("tcp"):
                found.append((pid, table.rstrip("6"), *_address(fields[1])))
    return found


def on_every_interface(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """The sockets of `listening_sockets` that other hosts could reach: bound to 0.0.0.0 or ::."""
    return [s for s in listening_sockets(pids) if s[2] in ("0.0.0.0", "::")]


def established_to(pid: int, port: int) -> int:
    """How many TCP connections to local `port` the process `pid` holds open (accepted ones:
    an API server's clients)."""
    return sum(
        fields[3] == "01" and _address(fields[1])[1] == port
        for _, fields in _owned_rows(pid, ("tcp", "tcp6"))
    )
