"""`triode bench fleet`: several triode instances behind vllm-router, compared by routing policy.

For each instance count N of `--instances`, starts N `triode serve` instances of the default
model at once, each publishing its KV-cache events on loopback ports of its own, and runs the
same multi-turn chat workload through each configuration of `--policies` in turn, on the same
instances: `direct` (no router: this client takes the instances in turn, request by request, the
baseline for what the router adds), then vllm-router with `round_robin`, `cache_aware` and
`kv_aware` (told each instance's event and replay endpoints). Before each configuration every
instance's prefix cache is emptied (`POST /reset_prefix_cache`, hence `--enable-admin-api`), so
each starts cold; each router runs on free ports of its own and only for its configuration.

The workload: `--users` users in groups of `--group-size`, each group with a system prompt of
about `--system-tokens` tokens of its own; each user sends `--turns` questions in order, turn k
carrying the system prompt, the user's earlier questions with the answers it got, and a new
question; greedy answers of `--max-tokens` tokens (`ignore_eos`), streamed; user i arrives
`i * --arrival-interval` seconds after the first (default: all at once). `--concurrency`
users (by default all) chat at once.

Prints per configuration the prefix-cache hit rate (prompt tokens found in the cache over those
looked up, from the growth of the instances' own `triode:prefix_cache_*` counters), TTFT p50 and
p99 and the end-to-end median as this client measures them, output tokens per second, and the
requests that succeeded and failed; then the router's added latency (round_robin's TTFT median
minus direct's) and kv_aware's hit rate and TTFT median against round_robin's.

The instances share this machine's cores (each pinned to its share of them, so that each runs
as many torch threads as it has cores), with the router and this client: absolute throughput
and TTFT are not a fleet's of real machines; the hit rates, and the TTFTs of one table against
each other, are what carry over.

`fleet_workload` builds the chats and times the requests; `fleet_report` writes the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from triode.wire.ports import free_port

from ..errors import leaf_errors
from .fleet_report import (
    DIRECT,
    CacheCounters,
    cache_counters,
    format_table,
    not_run,
    summarize,
)
from .fleet_workload import Conversation, build_conversations, probe, run_workload, warm_up
from .frontend import cpu_model
from .router_process import POLICIES, kv_events_config, router_command
from .serve import KEEPALIVE_EXPIRY, concurrency_list
from .serve_report import json_safe
from .server_process import open_server, serve_command

CONFIGS = (DIRECT, "round_robin", "cache_aware", "kv_aware")
MAX_MODEL_LEN = 4096
READY_TIMEOUT = 600.0  # N instances starting at once on a few shared cores


@dataclass(frozen=True)
class Instance:
    """One `triode serve`: its HTTP port, and its KV events' publisher and replay ports."""

    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def instance_cpus(index: int, count: int, cpus: Sequence[int]) -> list[int]:
    """Instance `index`'s share of `cpus`: an equal, contiguous part, or one CPU in turn where
    there are more instances than CPUs."""
    per = len(cpus) // count
    if per == 0:
        return [cpus[index % len(cpus)]]
    return list(cpus[index * per : (index + 1) * per])


def instance_command(
    instance: Instance, cpus: Sequence[int], kv_cache_memory: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The instance's command line, pinned to `cpus` with `taskset` where there is one (triode
    runs a torch thread per CPU it may use), and its environment."""
    command = serve_command(None, instance.port)
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--enable-admin-api"]
    if kv_cache_memory is not None:
        command += ["--kv-cache-memory", kv_cache_memory]
    command += ["--kv-events-config", kv_events_config(instance.events_port, instance.replay_port)]
    taskset = shutil.which("taskset")
    if taskset:
        command = [taskset, "-c", ",".join(map(str, cpus)), *command]
    env = {"OMP_NUM_THREADS": str(len(cpus)), "HF_HUB_OFFLINE": "1"}
    return command, env


@asynccontextmanager
async def open_instances(
    count: int, kv_cache_memory: str | None = None
) -> AsyncIterator[list[Instance]]:
    """`count` instances, started at once, until each answers `/health`; all stop on exit.
    Raises what `open_server` raises for any of them."""
    instances = [Instance() for _ in range(count)]
    cpus = sorted(os.sched_getaffinity(0))
    done = trio.Event()

    async def serve(instance: Instance, index: int, *, task_status: Any) -> None:
        command, env = instance_command(
            instance, instance_cpus(index, count, cpus), kv_cache_memory
        )
        async with open_server(command, instance.url, ready_timeout=READY_TIMEOUT, env=env):
            task_status.started()
            await done.wait()

    async with trio.open_nursery() as nursery:
        try:
            async with trio.open_nursery() as starting:
                for index, instance in enumerate(instances):
                    starting.start_soon(nursery.start, serve, instance, index)
            yield instances
        finally:
            done.set()


@asynccontextmanager
async def open_entry(config: str, instances: Sequence[Instance]) -> AsyncIterator[list[str]]:
    """Where `config`'s requests go: the instances themselves for `direct`, else a router with
    that policy over them, until it answers `/health` (stopped on exit)."""
    urls = [i.url for i in instances]
    if config == DIRECT:
        yield urls
        return
    port = free_port()
    kv: dict[str, Any] = {}
    if config == "kv_aware":
        kv = {"kv_events": {i.url: i.events for i in instances}}
        kv["kv_replay"] = {i.url: i.replay for i in instances}
    command = router_command(
        urls, port, policy=config, prometheus_port=free_port(), model="triode-fleet", **kv
    )
    url = f"http://127.0.0.1:{port}"
    async with open_server(command, url, ready_timeout=120.0, env={"RUST_LOG": "warn"}):
        yield [url]


async def read_counters(
    client: httpx.AsyncClient, instances: Sequence[Instance]
) -> list[CacheCounters]:
    """Each instance's prefix-cache counters. Raises `httpx.HTTPError` where one fails."""
    counters = []
    for instance in instances:
        response = await client.get(f"{instance.url}/metrics")
        response.raise_for_status()
        counters.append(cache_counters(response.text))
    return counters


async def reset_caches(client: httpx.AsyncClient, instances: Sequence[Instance]) -> None:
    """Empty every instance's prefix cache. Raises `RuntimeError` where one refuses."""
    for instance in instances:
        response = await client.post(f"{instance.url}/reset_prefix_cache")
        if response.status_code != 200 or not response.json().get("reset"):
            raise RuntimeError(f"{instance.url} did not reset its prefix cache: {response.text}")


async def run_count(
    count: int, args: argparse.Namespace, conversations: Sequence[Conversation]
) -> tuple[int, list[dict[str, Any]]]:
    """Every configuration of `args.policies` over `count` instances: the first system
    prompt's length in tokens, and a summary per configuration. A router that does not start,
    or a reset that fails, gives its configuration a summary without figures, with the error.
    Raises what `open_instances` raises, and `RuntimeError` where a warm-up request fails."""
    expected = len(conversations) * args.turns
    concurrency = args.concurrency or len(conversations)
    limits = httpx.Limits(
        max_connections=concurrency + count + 1,
        max_keepalive_connections=None,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    timeout = httpx.Timeout(30.0, read=300.0, pool=None)
    summaries = []
    print(f"starting {count} instances", file=sys.stderr)
    async with (
        open_instances(count, args.kv_cache_memory) as instances,
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
    ):
        model = await _model_id(client, instances[0])
        system = await _token_count(client, instances[0], conversations[0].system)
        await warm_up(client, [i.url for i in instances], model, count)
        for config in args.policies:
            print(f"{count} instances: {config}", file=sys.stderr)
            try:
                async with open_entry(config, instances) as urls:
                    await warm_up(client, urls, model, count)
                    idle = None
                    if config == "round_robin":
                        idle = await probe(client, urls[0], [i.url for i in instances], model)
                    await reset_caches(client, instances)
                    before = await read_counters(client, instances)
                    results, duration = await run_workload(
                        client, urls, conversations, model=model,
                        max_tokens=args.max_tokens, concurrency=concurrency,
                        arrival_interval=args.arrival_interval,
                    )  # fmt: skip
                    after = await read_counters(client, instances)
            except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as e:
                summaries.append(not_run(config, count, expected, f"{type(e).__name__}: {e}"))
                continue
            summary = summarize(config, results, duration, before, after, expected)
            if idle is not None:
                summary["idle_ttft_p50_ms"] = {"router": idle[0], "direct": idle[1]}
            summary["requests"] = [{**asdict(r), "itl": None} for r in results]
            summaries.append(summary)
    return system, summaries


async def _model_id(client: httpx.AsyncClient, instance: Instance) -> str:
    response = await client.get(f"{instance.url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _token_count(client: httpx.AsyncClient, instance: Instance, text: str) -> int:
    response = await client.post(f"{instance.url}/tokenize", json={"prompt": text})
    response.raise_for_status()
    return int(response.json()["count"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with `--instances` as `instance_counts` and `--policies` as a list."""
    parser = argparse.ArgumentParser(
        prog="triode bench fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--instances", default="2,4", help="instance counts, comma-separated")
    parser.add_argument(
        "--policies",
        default=",".join(CONFIGS),
        help=f"configurations, in this order: {DIRECT} or a router policy ({', '.join(POLICIES)})",
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8, help="users per system prompt")
    parser.add_argument("--system-tokens", type=int, default=1000, help="system prompt length")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--concurrency", type=int, help="users at once (default: all)")
    parser.add_argument(
        "--kv-cache-memory",
        help="each instance's KV cache (triode serve --kv-cache-memory; default: its own): "
        "a cache that cannot hold every group's prompt is where routing by cache matters",
    )
    parser.add_argument(
        "--arrival-interval",
        type=float,
        default=0.0,
        help="seconds between two users' first requests (default 0: all arrive at once)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)

    args.instance_counts = concurrency_list(parser, args.instances, "--instances")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in (DIRECT, *POLICIES)]
    if unknown or not args.policies:
        parser.error(f"--policies takes {DIRECT} and {', '.join(POLICIES)}, not {unknown}")
    for name in ("users", "turns", "group_size", "system_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.arrival_interval < 0:
        parser.error("--arrival-interval must be >= 0")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    return args


def header(args: argparse.Namespace, argv: Sequence[str]) -> str:
    """What ran where, and what the figures mean."""
    cpus = sorted(os.sched_getaffinity(0))
    groups = -(-args.users // args.group_size)
    shares = ", ".join(f"{n} instances: {_share(n, len(cpus))}" for n in args.instance_counts)
    pinning = (
        "pinned with taskset; triode runs a torch thread per CPU it may use"
        if shutil.which("taskset")
        else "not pinned (no taskset): OMP_NUM_THREADS set to the share, which triode's own "
        "torch.set_num_threads overrides"
    )
    return "\n".join([
        f"CPU: {cpu_model()}, {len(cpus)} cores",
        f"command: triode bench fleet {' '.join(argv)}".rstrip(),
        f"workload: {args.users} users in {groups} group(s) of {args.group_size} sharing a "
        f"~{args.system_tokens}-token system prompt, {args.turns} turns each, "
        f"{args.max_tokens} greedy tokens per answer, "
        f"{args.concurrency or args.users} users at once, arriving "
        + (f"{args.arrival_interval:g} s apart" if args.arrival_interval else "together"),
        f"instances: the default model, --max-model-len {MAX_MODEL_LEN}"
        + (f", --kv-cache-memory {args.kv_cache_memory}" if args.kv_cache_memory else "")
        + f"; {shares} ({pinning})",
        "The instances, the router and this client share these cores: absolute tok/s and TTFT "
        "are not a fleet's of real machines; the hit rates, and each table's TTFTs against "
        "each other, are the comparable figures.",
        "",
    ])  # fmt: skip


def _share(count: int, cpus: int) -> str:
    if count <= cpus:
        return f"{cpus // count} CPU(s) each"
    return f"1 CPU each, {-(-count // cpus)} to a CPU"


def run_or_error(
    count: int, args: argparse.Namespace, conversations: Sequence[Conversation]
) -> tuple[int, list[dict[str, Any]]] | str:
    """`run_count`'s result, or what stopped it (an instance that did not start or serve), its
    exceptions' messages one after the other."""
    try:
        return trio.run(run_count, count, args, conversations)
    except* (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as group:
        errors = [f"{type(e).__name__}: {e}" for e in leaf_errors(group)]
    return "\n".join(errors)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    conversations = build_conversations(
        args.users, args.turns, args.group_size, args.system_tokens, args.seed
    )
    print(header(args, argv), flush=True)
    report: dict[str, Any] = {"config": {**vars(args), "json": str(args.json)}, "runs": []}
    for count in args.instance_counts:
        outcome = run_or_error(count, args, conversations)
        if isinstance(outcome, str):
            print(f"{count} instances did not run:\n{outcome}\n", flush=True)
            report["runs"].append({"instances": count, "error": outcome})
        else:
            system, summaries = outcome
            print(f"system prompt of group 0: {system} tokens")
            print(format_table(summaries) + "\n", flush=True)
            report["runs"].append({"instances": count, "system_prompt_tokens": system,
                                   "summaries": summaries})  # fmt: skip
        if args.json:  # after each count: a later one that hangs or is interrupted loses none
            args.json.write_text(json.dumps(json_safe(report), indent=2))


if __name__ == "__main__":
    main()
