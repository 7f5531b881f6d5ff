"""Free TCP ports for a server or a rendezvous to bind a moment later.

A port the kernel picked for a probe socket (a bind to port 0) comes from its ephemeral range,
which is also where every outgoing connection gets its local port: between the probe and the
bind, a gloo rank's, a ZMQ peer's or an HTTP client's connection can take it, and the bind
fails with "address already in use". A port below that range is never handed out that way, so
only another explicit bind can take it. The candidates come from a generator of this module's
own, seeded by the OS: two processes whose global `random` an application (or a test runner)
seeded alike would otherwise try the same ports in the same order; a forked child seeds it anew,
as `random` does its own (processes forked from one fork server would share its sequence).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: the well-known services' neighbourhood
TRIES = 64
_candidates = random.Random()
os.register_at_fork(after_in_child=_candidates.seed)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, below the ephemeral range where there is
    room for one (else one the kernel picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ephemeral = _ephemeral_start()
    for _ in range(TRIES if ephemeral > LOWEST else 0):
        port = _candidates.randrange(LOWEST, ephemeral)
        with socket.socket(family) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot tell)."""
    try:
        return int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
