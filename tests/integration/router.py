"""A real vllm-router process on a free loopback port, in front of test servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from server import wait_for_health

from triode.edge.bench.router_process import router_binary, router_command
from triode.wire.ports import free_port

START_TIMEOUT = 60.0


@contextlib.contextmanager
def running_router(
    worker_urls: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    **options: object,
) -> Iterator[str]:
    """`vllm-router` over `worker_urls` (`router_command`'s `options`: the policy, the KV
    event sources), until it answers `/health`; yields its base URL. On exit its process group
    is ended: SIGINT, then SIGKILL."""
    port = free_port()
    command = router_command(worker_urls, port, prometheus_port=free_port(), **options)  # type: ignore[arg-type]
    with running_router_command(command, port, log, env=env) as url:
        yield url


@contextlib.contextmanager
def running_router_command(
    command: list[str], port: int, log: Path, *, env: dict[str, str] | None = None
) -> Iterator[str]:
    """The router `command` (listening on `port`) until it answers `/health`."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RUST_LOG": "info", **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(process, url, log, START_TIMEOUT)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def pd_router_command(prefill: str, decode: str, port: int) -> list[str]:
    """vllm-router in front of one prefill and one decode instance (its NIXL-style P/D mode:
    the prefill's `kv_transfer_params` handed to the decode)."""
    return [
        router_binary(), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
