"""`triode fuzz chaos`: minutes of mixed load against a real server while processes are killed.

```sh
triode fuzz chaos --minutes 30 [--seed S] [--launch MODEL] [--profiles parallel,speculative]
```

Each profile launches `triode serve` on the model (tiny-random unless `--launch` names
another) with the admin API and a key, and runs for its share of the minutes:

- `parallel`: two tensor-parallel ranks, two API servers, LoRA adapters: the victims are the
  engine core, either rank and either API server;
- `speculative`: ngram speculative decoding: the victim is the engine core.

Clients send the mix of `chaos_load.py` all the while; one operator, at random times, loads
and unloads an adapter, puts the engine to sleep and wakes it, pauses and resumes it, has it
read its weights from disk again and resets its prefix cache, and SIGKILLs a victim. After a
kill it waits until the server is back (the victim's place taken, `/health` 200) and checks
that the greedy canary answer and the adapters served are what they were. The invariants
(`chaos_checks.py`) are printed as a table per profile; the exit status is 1 after a violation.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from triode.edge.bench.process_tree import ProcessTree
from triode.edge.bench.server_process import open_server, serve_command
from triode.wire.ports import free_port

from .chaos_checks import Ledger
from .chaos_load import REQUEST_TIMEOUT, Load
from .cli import DEFAULT_API_KEY, LAUNCH_ENV
from .http_fuzzer import Checker, Target
from .processes import alive
from .report import Violation

ADAPTER = "chaos-adapter"
CANARY = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
# how long a killed process's place may take to be taken, the server healthy again
RECOVERY_TIMEOUT = 120.0
MEMORY_INTERVAL = 2.0
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Profile:
    flags: tuple[str, ...]
    victims: tuple[str, ...]  # actor names (their /proc comm) that the operator kills
    lora: bool = False


PROFILES = {
    "parallel": Profile(
        ("--tensor-parallel-size", "2", "--api-server-count", "2", "--enable-lora",
         "--max-loras", "2", "--max-lora-rank", "8"),
        ("engine-core", "worker-0", "worker-1", "api-server-0", "api-server-1"),
        lora=True,
    ),
    "speculative": Profile(
        ("--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'),
        ("engine-core",),
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode fuzz chaos",
        description="Mixed load against a real server while its processes are SIGKILLed; "
        "invariants as a table at the end, exit status 1 on a violation.",
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="the whole run (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--launch", default="tiny-random", metavar="MODEL", help="the model (default tiny-random)"
    )
    parser.add_argument(
        "--profiles",
        default="parallel,speculative",
        help="the servers, one after another, each for its share of the minutes "
        f"({', '.join(PROFILES)})",
    )
    parser.add_argument("--concurrency", type=int, default=6, help="clients at once")
    parser.add_argument(
        "--kill-every", type=float, default=20.0, help="mean seconds between kills (default 20)"
    )
    parser.add_argument(
        "--operate-every",
        type=float,
        default=4.0,
        help="mean seconds between administrative operations (default 4)",
    )
    args = parser.parse_args(argv)
    args.profile_list = [p.strip() for p in args.profiles.split(",") if p.strip()]
    unknown = [p for p in args.profile_list if p not in PROFILES]
    if unknown or not args.profile_list:
        parser.error(f"--profiles takes {', '.join(PROFILES)}, not {args.profiles!r}")
    if not args.minutes > 0 or args.concurrency < 1:
        parser.error("--minutes must be positive, --concurrency at least 1")
    if not (args.kill_every > 0 and args.operate_every > 0):
        parser.error("--kill-every and --operate-every must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the server executes its own actors, so that they are its process tree's
    os.environ.pop("TRIODE_FORKSERVER", None)
    for name, value in LAUNCH_ENV.items():
        os.environ.setdefault(name, value)
    seconds = args.minutes * 60 / len(args.profile_list)
    ledgers = []
    for i, name in enumerate(args.profile_list):
        ledger = Ledger(f"{name} (seed {args.seed}, {args.launch})")
        trio.run(run_profile, PROFILES[name], args, seconds, args.seed * 100 + i, ledger)
        print(ledger.table(), flush=True)
        ledgers.append(ledger)
    return 1 if any(ledger.violations for ledger in ledgers) else 0


async def run_profile(
    profile: Profile, args: argparse.Namespace, seconds: float, seed: int, ledger: Ledger
) -> None:
    """One server of `profile` under load and kills for `seconds`, judged into `ledger`; the
    adapter it loads lives in a directory that goes with the run."""
    with tempfile.TemporaryDirectory(prefix="triode-chaos-") as adapters:
        await _run_server(profile, args, seconds, seed, ledger, Path(adapters))


async def _run_server(
    profile: Profile,
    args: argparse.Namespace,
    seconds: float,
    seed: int,
    ledger: Ledger,
    adapters: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*serve_command(None if args.launch == "default" else args.launch, port)]
    command += ["--api-key", DEFAULT_API_KEY, "--enable-admin-api", "--max-model-len", "1024"]
    command += ["--max-engine-restarts", "1000", "--engine-restart-window", "60"]
    command += [*profile.flags]
    if profile.lora:
        command += ["--allowed-lora-paths", str(adapters)]
    shared_before = _shared_segments()
    print(f"starting {' '.join(command[3:])}", file=sys.stderr, flush=True)
    async with open_server(command, url) as process:
        tree = ProcessTree(process.pid)
        headers = {"authorization": f"Bearer {DEFAULT_API_KEY}"}
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=REQUEST_TIMEOUT
        ) as client:
            [card] = (await client.get("/v1/models")).json()["data"]
            if profile.lora:  # the model's side writes it, from its config.json
                await trio.run_process(
                    [sys.executable, "-m", "triode.gpu.lora.random_adapter", card["root"],
                     str(adapters / ADAPTER), "--rank", "8", "--seed", str(seed)],
                )  # fmt: skip
            operator = Operator(client, profile, tree, ledger, random.Random(seed), card, adapters)
            operator.canary = await operator.greedy()
            deadline = time.monotonic() + seconds
            loads = [
                Load(client, card["id"], random.Random(seed * 1000 + i))
                for i in range(args.concurrency)
            ]
            operator.loads = loads
            async with trio.open_nursery() as nursery:
                for load in loads:
                    nursery.start_soon(_requests, load, ledger, deadline)
                nursery.start_soon(_memory, tree, ledger, deadline)
                await operator.run(deadline, args.kill_every, args.operate_every)
            await operator.check_idle()
        tree.scan()
    ledger.judge_memory()
    left = tree.still_running()
    leaked = _shared_segments() - shared_before
    ledger.left.check(not left and not leaked, f"processes {left}, shared memory {leaked}")


async def _requests(load: Load, ledger: Ledger, deadline: float) -> None:
    while time.monotonic() < deadline:
        outcome = await load.one()
        ledger.record(outcome)
        if outcome.result in ("error", "lost"):
            await trio.sleep(0.2)  # a server restarting: not a busy loop meanwhile


async def _memory(tree: ProcessTree, ledger: Ledger, deadline: float) -> None:
    while time.monotonic() < deadline:
        ledger.sample_memory(tree.rss_bytes())
        await trio.sleep(MEMORY_INTERVAL)


@dataclass
class Operator:
    """The one who operates the server while clients use it: administrative operations and
    kills, one at a time."""

    client: httpx.AsyncClient
    profile: Profile
    tree: ProcessTree
    ledger: Ledger
    rng: random.Random
    card: dict
    adapters: Path
    canary: str = ""
    adapter_loaded: bool = False
    loads: list[Load] = field(default_factory=list)

    async def run(self, deadline: float, kill_every: float, operate_every: float) -> None:
        next_kill = time.monotonic() + self.rng.expovariate(1 / kill_every)
        while (now := time.monotonic()) < deadline:
            if now >= next_kill:
                await self.kill()
                next_kill = time.monotonic() + self.rng.expovariate(1 / kill_every)
                continue
            pause = min(self.rng.expovariate(1 / operate_every), next_kill - now, deadline - now)
            await trio.sleep(max(0.0, pause))
            if time.monotonic() < min(next_kill, deadline):
                await self.operate()

    async def greedy(self) -> str:
        for _ in range(int(RECOVERY_TIMEOUT)):
            response = await self.client.post("/v1/completions", json=CANARY)
            if response.status_code == 200:
                return str(response.json()["choices"][0]["text"])
            await trio.sleep(1.0)  # a restart that is not over (a kill the operator did not see)
        raise RuntimeError(f"the canary was not answered: {response.status_code}")

    # administrative operations

    async def operate(self) -> None:
        choices = ["sleep", "pause", "weights", "reset"] + (
            ["adapter"] * 2 if self.profile.lora else []
        )
        operation = self.rng.choice(choices)
        await getattr(self, "_" + operation)()

    async def _call(self, name: str, method: str, path: str, **kwargs: object) -> int | None:
        started = time.monotonic()
        try:
            response = await self.client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError:
            status = None  # an API server killed under it: only around a kill
        else:
            status = response.status_code
        self.ledger.operations[f"{name} {status}"] += 1
        if status is None or status >= 500:
            around = self.ledger.restarting(started) or self.ledger.restarting(time.monotonic())
            allowed = around and status in (None, 503)
            self.ledger.no_5xx.check(
                allowed, f"{name} at {started - self.ledger.started:.1f} s: {status}"
            )
        return status

    async def _sleep(self) -> None:
        level = self.rng.choice([1, 2])
        if await self._call("sleep", "POST", f"/sleep?level={level}") == 200:
            await trio.sleep(self.rng.uniform(0.2, 1.5))
        await self._call("wake_up", "POST", "/wake_up")

    async def _pause(self) -> None:
        mode = self.rng.choice(["abort", "wait", "keep"])
        if await self._call("pause", "POST", f"/pause?mode={mode}") == 200:
            await trio.sleep(self.rng.uniform(0.2, 1.0))
        await self._call("resume", "POST", "/resume")

    async def _weights(self) -> None:
        body = {"model_path": self.card["root"]}
        await self._call("update_weights_from_disk", "POST", "/update_weights_from_disk", json=body)

    async def _reset(self) -> None:
        await self._call("reset_prefix_cache", "POST", "/reset_prefix_cache")

    async def _adapter(self) -> None:
        if not self.adapter_loaded:
            body = {"lora_name": ADAPTER, "lora_path": str(self.adapters / ADAPTER)}
            if (
                await self._call("load_lora_adapter", "POST", "/v1/load_lora_adapter", json=body)
                == 200
            ):
                self.adapter_loaded = True
                for load in self.loads:
                    load.adapter = ADAPTER
        else:
            for load in self.loads:
                load.adapter = None
            body = {"lora_name": ADAPTER}
            if (
                await self._call(
                    "unload_lora_adapter", "POST", "/v1/unload_lora_adapter", json=body
                )
                == 200
            ):
                self.adapter_loaded = False

    # kills

    async def kill(self) -> None:
        actors = self.actors()
        victims = [name for name in self.profile.victims if name in actors]
        if not victims:
            return
        victim = self.rng.choice(victims)
        engine_before = actors.get("engine-core")
        try:
            os.kill(actors[victim], signal.SIGKILL)
        except ProcessLookupError:
            return
        window = self.ledger.killed(victim)
        started = time.monotonic()
        # back when the victim's place is taken (a rank's death takes its engine core with it)
        replaced = "engine-core" if victim.startswith(("engine", "worker")) else victim
        old = engine_before if replaced == "engine-core" else actors[victim]
        while time.monotonic() - started < RECOVERY_TIMEOUT:
            now = self.actors()
            if now.get(replaced) not in (None, old) and await self._healthy():
                break
            await trio.sleep(0.1)
        else:
            self.ledger.greedy.check(False, f"{victim}'s kill: not back in {RECOVERY_TIMEOUT:g} s")
            self.ledger.recovered(window)
            return
        self.ledger.recovered(window)
        if replaced == "engine-core":
            self.ledger.restarts += 1
        answer = await self.greedy()
        served = {m["id"] for m in (await self.client.get("/v1/models")).json()["data"]}
        when = f"after {victim}'s kill at {started - self.ledger.started:.1f} s"
        self.ledger.greedy.check(answer == self.canary, f"{when}: {answer!r}, not {self.canary!r}")
        self.ledger.greedy.check(
            (ADAPTER in served) == self.adapter_loaded,
            f"{when}: the adapter is {'not ' if self.adapter_loaded else ''}served",
        )

    async def _healthy(self) -> bool:
        try:
            return (await self.client.get("/health", timeout=5)).status_code == 200
        except httpx.TransportError:
            return False

    def actors(self) -> dict[str, int]:
        """The server's actors by name (their /proc comm), below its process."""
        found = {}
        for pid in self.tree.scan():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if alive(pid):
                found[name] = pid
        return found

    # at the end

    async def check_idle(self) -> None:
        """With the load stopped: nothing running or waiting and the KV cache empty, as the
        live fuzzer waits for it (`Checker.drained`)."""
        checker = Checker(Target(str(self.client.base_url), DEFAULT_API_KEY), self.client)
        try:
            await checker.drained(kv_empty=True)
        except Violation as e:
            self.ledger.idle.check(False, e.message)
        else:
            self.ledger.idle.check(True, "")


def _shared_segments() -> set[str]:
    return {p.name for p in SHM.glob("triode*")}
