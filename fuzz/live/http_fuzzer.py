"""The HTTP side of the live fuzzer: raw, mutated HTTP/1.1 against a running triode server.

What is sent is `HttpMutator`'s business (`http_mutator.py`), how it is sent `raw_http.py`'s (as
bytes on a plain TCP stream, so nothing on the way normalises them). This module runs the rounds
and checks the invariants:

- per response: no 5xx; nothing under `/v1` (however the path is spelled) answers 2xx without a
  valid key; a valid key is never refused with 401; a complete request gets an answer, in time,
  before its connection closes;
- between rounds: the server and engine processes run, `/health` is 200, the scheduler drains
  (no request left running or waiting once its client is gone), a greedy canary completion gives
  the same text as at the start, and resident memory stays below 1.5x + 200 MiB of its value
  after the first round;
- at the end: `/metrics` shows no request running and the KV cache empty.
"""

from __future__ import annotations

import argparse
import posixpath
import random
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from triode.edge.bench.server_process import open_server, serve_command
from triode.wire.ports import free_port

from .cli import DEFAULT_API_KEY, engine_flags, launch_model
from .http_mutator import HttpMutator
from .http_plan import INVALID, VALID, Plan
from .processes import MemoryWatch, alive, child_pids
from .raw_http import REQUEST_TIMEOUT, Outcome, exchange
from .report import Report, Violation, crash_path

ROUND_SECONDS = 2.5
IDLE_TIMEOUT = 15.0
CANARY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@dataclass
class Target:
    """The server under test: where it listens, its key, and its processes (when launched)."""

    url: str
    key: str | None
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


# Per-response invariants


def under_v1(target: bytes) -> bool:
    """Whether a request target names something under `/v1` by any reading: absolute form,
    percent-escapes (twice), dot segments, doubled or back slashes, case."""
    path = _any_reading(target)
    return path == "/v1" or path.startswith("/v1/")


def needs_key(target: bytes) -> bool:
    """Whether a request target names, by any reading, a route that only a key may reach:
    anything under `/v1`, `/tokenize`, `/detokenize` and what routers ask (`/get_load`,
    `/get_server_info`, `/kv_event_sources`)."""
    return under_v1(target) or _any_reading(target) in _KEYED


_KEYED = ("/tokenize", "/detokenize", "/get_load", "/get_server_info", "/kv_event_sources")


def _any_reading(target: bytes) -> str:
    path = target.decode("latin-1")
    if "://" in path:
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    path = path.split("?", 1)[0].split("#", 1)[0]
    for _ in range(2):
        path = urllib.parse.unquote(path, encoding="latin-1")
    path = posixpath.normpath("/" + path.replace("\\", "/")).lower()
    return "/" + path.lstrip("/")


def check_outcome(plan: Plan, outcome: Outcome, keyed: bool) -> str | None:
    """What is wrong with the answers to `plan`, or None. `keyed`: the server requires keys."""
    for i, status in enumerate(outcome.statuses):
        req = plan.requests[min(i, len(plan.requests) - 1)]
        body = outcome.bodies[i][:300].decode(errors="replace")
        what = f"{req.method.decode('latin-1')[:40]} {req.target.decode('latin-1')[:120]}"
        if status >= 500 and not (status == 501 and req.unknown_coding):
            return f"{plan.kind}: {what} answered {status}: {body}"
        if not keyed or req.method == b"OPTIONS":
            continue
        if 200 <= status < 300 and req.auth == INVALID and needs_key(req.target):
            return f"{plan.kind}: {what} answered {status} without a valid key: {body}"
        if status == 401 and req.auth == VALID:
            return f"{plan.kind}: {what} refused a valid key: {body}"
    if not plan.expect_answer or len(outcome.statuses) >= len(plan.requests):
        return None
    if outcome.error == "timeout":
        return f"{plan.kind}: no answer within {REQUEST_TIMEOUT:g} s (answers: {outcome.statuses})"
    if outcome.error in ("eof", "reset") and not any(s >= 400 for s in outcome.statuses):
        # after a refusal the server may close; before one, a complete request is owed an answer
        return f"{plan.kind}: the connection closed without an answer ({outcome.error})"
    return None


# Invariants between rounds


class Checker:
    """The server-wide invariants, checked through a well-behaved client."""

    def __init__(self, target: Target, client: httpx.AsyncClient) -> None:
        self.target = target
        self.client = client
        self.memory = MemoryWatch(target.pids)
        self.canary_text: str | None = None

    async def start(self) -> str:
        """Check the server is up, note the canary's text; return the served model's name."""
        await self.health()
        models = await self.client.get("/v1/models")
        if models.status_code != 200:
            raise Violation(f"GET /v1/models with the key answered {models.status_code}")
        self.canary_text = await self.canary()
        return models.json()["data"][0]["id"]

    async def health(self) -> None:
        for name, pid in self.target.pids.items():
            if not alive(pid):
                raise Violation(f"the {name} process (pid {pid}) died")
        try:
            response = await self.client.get("/health")
        except httpx.HTTPError as e:
            raise Violation(f"GET /health failed: {e!r}") from None
        if response.status_code != 200:
            raise Violation(f"GET /health answered {response.status_code}: {response.text}")

    async def canary(self) -> str:
        response = await self.client.post("/v1/completions", json=CANARY)
        if response.status_code != 200:
            raise Violation(f"the canary answered {response.status_code}: {response.text}")
        return response.json()["choices"][0]["text"]

    async def scheduler(self) -> dict[str, float]:
        response = await self.client.get("/metrics")
        if response.status_code != 200:
            raise Violation(f"GET /metrics answered {response.status_code}")
        values = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                values[sample.name] = sample.value
        return {
            "running": values.get("triode:num_requests_running", -1),
            "waiting": values.get("triode:num_requests_waiting", -1),
            "kv": values.get("triode:kv_cache_usage_perc", -1),
        }

    async def drained(self, *, kv_empty: bool) -> None:
        """Wait until nothing runs or waits (and, with `kv_empty`, no KV block is held)."""
        with trio.move_on_after(IDLE_TIMEOUT):
            while True:
                now = await self.scheduler()
                if now["running"] == 0 and now["waiting"] == 0 and (not kv_empty or now["kv"] == 0):
                    return
                await trio.sleep(0.1)
        raise Violation(
            f"the scheduler did not drain within {IDLE_TIMEOUT:g} s of the clients leaving: "
            f"{now['running']:g} running, {now['waiting']:g} waiting, KV usage {now['kv']:g}"
        )

    async def between_rounds(self, *, final: bool = False) -> None:
        await self.health()
        await self.drained(kv_empty=final)
        text = await self.canary()
        if text != self.canary_text:
            raise Violation(f"the canary changed: {self.canary_text!r} -> {text!r}")
        if (grown := self.memory.check()) is not None:
            raise Violation(grown)


# Running


@asynccontextmanager
async def open_target(args: argparse.Namespace) -> AsyncIterator[Target]:
    """The server at `--url`, or one launched on `--launch`'s model with a key."""
    if args.url:
        yield Target(args.url.rstrip("/"), args.api_key)
        return
    key = args.api_key or DEFAULT_API_KEY
    port = free_port()
    command = [*serve_command(launch_model(args, None), port), "--api-key", key]
    for flag, value in engine_flags(args).items():
        command += [f"--{flag.replace('_', '-')}", str(value)]
    url = f"http://127.0.0.1:{port}"
    print(f"starting {' '.join(command[1:])}", file=sys.stderr, flush=True)
    async with open_server(command, url) as process:
        pids = {"server": process.pid}
        engines = child_pids(process.pid)
        if engines:
            pids["engine"] = engines[0]
        yield Target(url, key, pids)


def _client(target: Target) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {target.key}"} if target.key else {}
    return httpx.AsyncClient(base_url=target.url, headers=headers, timeout=REQUEST_TIMEOUT)


async def fuzz(args: argparse.Namespace) -> Report:
    """Run the HTTP fuzzer for `args.seconds` and return its report."""
    report = Report("http", args.seed)
    async with open_target(args) as target, _client(target) as client:
        started = time.perf_counter()
        try:
            await run(target, client, args, report)
        except Violation as v:
            report.violations.append(v.message)
            if v.reproducer is not None:
                report.replay = f"python -m triode.fuzz.live replay {v.reproducer} " + (
                    f"--url {args.url}" + (" --api-key KEY" if target.key else "")
                    if args.url
                    else f"--launch {args.launch or ''}".rstrip()
                )
        report.seconds = time.perf_counter() - started
    return report


async def run(
    target: Target, client: httpx.AsyncClient, args: argparse.Namespace, report: Report
) -> None:
    checker = Checker(target, client)
    model = await checker.start()
    keyed = target.key is not None
    deadline = trio.current_time() + args.seconds
    round_no = 0
    while True:
        round_no += 1
        stop_at = min(deadline, trio.current_time() + ROUND_SECONDS)
        plans = await _round(target, model, args, round_no, stop_at, report, keyed)
        report.rounds += 1
        try:
            await checker.between_rounds()
        except Violation as v:
            v.reproducer = _write_round(plans, f"http-round{round_no}", args.crash_dir)
            raise
        if round_no == 1:
            checker.memory.settle()
        if trio.current_time() >= deadline:
            break
    await checker.between_rounds(final=True)


async def _round(
    target: Target,
    model: str,
    args: argparse.Namespace,
    round_no: int,
    stop_at: float,
    report: Report,
    keyed: bool,
) -> list[Plan]:
    host, port = target.host_port
    plans: list[Plan] = []
    found: list[Violation] = []

    async def worker(rng: random.Random, scope: trio.CancelScope) -> None:
        mutator = HttpMutator(rng, f"{host}:{port}".encode(), target.key, model)
        while trio.current_time() < stop_at:
            plan = mutator.plan()
            plans.append(plan)
            report.sent[plan.kind] += 1
            outcome = await exchange(plan, host, port)
            for status in outcome.statuses:
                report.outcomes[str(status)] += 1
            if outcome.error:
                report.outcomes[outcome.error] += 1
            problem = check_outcome(plan, outcome, keyed)
            if problem is not None:
                name = f"http-{plan.kind}{plan.how()}"
                path = crash_path(name, args.crash_dir).with_suffix(".http")
                path.write_bytes(plan.raw())
                found.append(Violation(problem, path))
                scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        for w in range(args.concurrency):
            rng = random.Random(f"{args.seed}/{round_no}/{w}")
            nursery.start_soon(worker, rng, nursery.cancel_scope)
    if found:
        raise found[0]
    return plans


def _write_round(plans: list[Plan], name: str, directory: Path | None) -> Path:
    folder = crash_path(name, directory)
    folder.mkdir()
    for i, plan in enumerate(plans):
        (folder / f"{i:05d}-{plan.kind}{plan.how()}.http").write_bytes(plan.raw())
    return folder


def _crash_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.http")) if path.is_dir() else [path]


async def replay(path: Path, args: argparse.Namespace) -> int:
    """Send a crash file (or a folder of them, in order) and check the invariants after."""
    files = await trio.to_thread.run_sync(_crash_files, path)
    async with open_target(args) as target, _client(target) as client:
        host, port = target.host_port
        checker = Checker(target, client)
        await checker.start()
        problems = []
        for file in files:
            data = await trio.Path(file).read_bytes()
            plan = Plan.replaying(data, file.name)
            outcome = await exchange(plan, host, port)
            print(f"{file.name}: {outcome.statuses} {outcome.error}".rstrip())
            for body in outcome.bodies:
                if body:
                    print("   ", body[:300].decode(errors="replace"))
            # which key a saved request carries is not known here: check all but the key rules
            if (problem := check_outcome(plan, outcome, keyed=False)) is not None:
                problems.append(problem)
        try:
            await checker.between_rounds(final=True)
        except Violation as v:
            problems.append(v.message)
    for problem in problems:
        print(f"violation: {problem}")
    if not problems:
        print("invariants hold")
    return 1 if problems else 0
