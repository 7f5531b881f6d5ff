"""vllm-router (the `vllm-router` package's launcher) in front of triode instances: its command
line for each policy, and the KV-event sources its `kv_aware` policy reads.

The benchmark (`triode bench fleet`) and the tests start it through this, as a process of its
own (`server_process.open_server`: the router answers `/health` once a worker does).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

POLICIES = ("round_robin", "random", "power_of_two", "consistent_hash", "cache_aware", "kv_aware")
# the block size the router's prefix index cuts prompts into: triode's KV block size
BLOCK_SIZE = 16


def router_binary() -> str:
    """The `vllm-router` launcher: on PATH, or beside this Python (a venv not activated)."""
    found = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(found).exists():
        raise FileNotFoundError("vllm-router is not installed: pip install vllm-router")
    return found


def router_command(
    worker_urls: Sequence[str],
    port: int,
    *,
    policy: str = "round_robin",
    prometheus_port: int,
    kv_events: Mapping[str, str] | None = None,
    kv_replay: Mapping[str, str] | None = None,
    model: str = "triode",
    health_interval: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    """The router on loopback `port` over `worker_urls` with `policy`.

    `kv_events` (worker URL -> its PUB endpoint, and `kv_replay` its replay endpoint) tells
    `kv_aware` where each instance publishes; without them `kv_aware` asks each instance
    (`/get_server_info`, `/kv_event_sources`). Health is checked every `health_interval`
    seconds, and a worker is waited for at start-up once a second (the launcher's defaults are
    60 and 30 s). The router's Prometheus port cannot be turned off: it is `prometheus_port`,
    on loopback.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    command = [router_binary(), "--worker-urls", *worker_urls]
    command += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    command += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "300"]
    command += ["--health-check-interval-secs", str(health_interval)]
    command += ["--health-failure-threshold", "1", "--health-success-threshold", "1"]
    for url, endpoint in (kv_events or {}).items():
        command += ["--kv-event-source", f"{url}={endpoint}"]
    for url, endpoint in (kv_replay or {}).items():
        command += ["--kv-event-replay-source", f"{url}={endpoint}"]
    if kv_events:
        command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
    return [*command, *extra]


def kv_events_config(port: int, replay_port: int | None = None) -> str:
    """`--kv-events-config` for an instance publishing on loopback `port` (and replaying on
    `replay_port`)."""
    replay = "null" if replay_port is None else f'"tcp://127.0.0.1:{replay_port}"'
    return (
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{port}", '
        f'"replay_endpoint": {replay}}}'
    )
