"""What the tests ask of processes they started: whether one still runs; and a world of rank
processes run to their end."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def run_ranks(target: Callable[..., None], args_of_rank: Sequence[tuple[Any, ...]]) -> None:
    """Run `target(*args)` in one spawned process per entry of `args_of_rank`, all at once;
    each must exit with status 0 within 240 s, and none outlives the call."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_of_rank]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert not any(p.is_alive() for p in procs)


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie is gone for every purpose but its exit status."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, protocol, address, port) of every TCP socket listening and every UDP socket bound
    by one of `pids`, from the kernel's socket tables (what `ss -ltnu` shows)."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6", "udp", "udp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except (FileNotFoundError, ProcessLookupError):
                continue
            for line in lines:
                fields = line.split()
                listening = fields[3] == "0A" if table.startswith("tcp") else True
                if listening and fields[9] in inodes:
                    found.append((pid, table.rstrip("6"), *_address(fields[1])))
    return found


def on_every_interface(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """The sockets of `listening_sockets` that other hosts could reach: bound to 0.0.0.0 or ::."""
    return [s for s in listening_sockets(pids) if s[2] in ("0.0.0.0", "::")]
