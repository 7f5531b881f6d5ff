"""vllm-router (the real binary, from PyPI) in front of two and four `triode serve` instances
of the default model, all on loopback: every endpoint through it, streamed and not; each policy; its
`kv_aware` policy fed by the instances' KV-cache events, told where they are or finding them
itself; and an instance killed under load and started again.

Greedy answers through the router must equal an instance's own.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from router import running_router
from server import START_TIMEOUT, Server, running_servers, wait_for_health

from triode.edge.bench.router_process import kv_events_config
from triode.edge.ignored_fields import HEADER
from triode.wire.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "smol"
ARGS = ["--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "16"]
# a prompt long enough to fill 12 blocks of 16 tokens, and its variants
PREFIX = " ".join(f"Rule {i}: every answer names the rule it follows." for i in range(20))


@dataclass
class Instance:
    server: Server
    events: str  # its PUB endpoint
    replay: str


def _instance_args() -> tuple[list[str], str, str]:
    pub, replay = free_port(), free_port()
    args = [*ARGS, "--kv-events-config", kv_events_config(pub, replay)]
    return args, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Instance]]:
    logs = tmp_path_factory.mktemp("fleet")
    specs = [_instance_args() for _ in range(4)]
    with running_servers(
        *((args, logs / f"instance{i}.log", None) for i, (args, _, _) in enumerate(specs))
    ) as servers:
        yield [Instance(s, pub, replay) for s, (_, pub, replay) in zip(servers, specs, strict=True)]


def _served(instance: Instance) -> float:
    """Requests the instance finished, by its metrics."""
    return _served_at(instance.server.url)


def _completion(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    if not stream:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        return out.choices[0].text
    with client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
    ) as chunks:
        return "".join(c.choices[0].text for c in chunks if c.choices)


def _chat(client: openai.OpenAI, content: str, stream: bool = False) -> str:
    messages: Any = [{"role": "user", "content": content}]
    if not stream:
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        return out.choices[0].message.content or ""
    with client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    ) as chunks:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _response(client: openai.OpenAI, text: str, stream: bool = False) -> str:
    if not stream:
        out = client.responses.create(
            model=MODEL, input=text, max_output_tokens=8, temperature=0, store=False
        )
        return out.output_text
    with client.responses.create(
        model=MODEL, input=text, max_output_tokens=8, temperature=0, store=False, stream=True
    ) as events:
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_every_endpoint_through_the_router_streamed_and_not(
    fleet: list[Instance], tmp_path: Path
) -> None:
    direct = _client(fleet[0].server.url)
    prompt, question = "The capital of France is", "What is the capital of France?"
    expected = {
        "completion": _completion(direct, prompt),
        "chat": _chat(direct, question),
        "response": _response(direct, question),
    }
    pair = fleet[:2]
    urls = [i.server.url for i in pair]
    before = [_served(i) for i in pair]
    with running_router(urls, tmp_path / "router.log", policy="round_robin") as url:
        client = _client(url)
        for stream in (False, True):
            for _ in range(2):  # round robin: each instance once
                assert _completion(client, prompt, stream) == expected["completion"]
                assert _chat(client, question, stream) == expected["chat"]
                assert _response(client, question, stream) == expected["response"]
        assert [m.id for m in client.models.list().data] == [MODEL]
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=10).json()
        text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10)
        assert tokens["count"] == len(tokens["tokens"]) and text.json()["prompt"] == prompt
        # a gateway's own field is ignored, and said to be, through the router too
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": question}],
                  "max_tokens": 8, "temperature": 0, "gateway_trace": "t-1"},
            timeout=60,
        )  # fmt: skip
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == expected["chat"]
        assert answer.headers[HEADER.decode()] == "gateway_trace"
        client.close()
    direct.close()
    # 13 generations through the router, round-robin over the two
    assert sorted(_served(i) - b for i, b in zip(pair, before, strict=True)) == [6, 7]


COLOURS = [f"Question {i}: name a colour." for i in range(4)]


@pytest.fixture(scope="module")
def colours(fleet: list[Instance]) -> list[str]:
    """An instance's own greedy answers to `COLOURS`."""
    direct = _client(fleet[1].server.url)
    answers = [_completion(direct, p) for p in COLOURS]
    direct.close()
    return answers


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("policy", ["random", "power_of_two", "consistent_hash", "cache_aware"])
def test_each_policy_serves_over_the_fleet(
    fleet: list[Instance], colours: list[str], policy: str, size: int, tmp_path: Path
) -> None:
    urls = [i.server.url for i in fleet[:size]]
    with running_router(urls, tmp_path / "router.log", policy=policy) as url:
        client = _client(url)
        got = [_completion(client, p, stream=i % 2 == 1) for i, p in enumerate(COLOURS)]
        client.close()
    assert got == colours


@pytest.mark.parametrize("told", [True, False], ids=["told", "discovered"])
def test_kv_aware_sends_a_cached_prefix_to_the_instance_that_holds_it(
    fleet: list[Instance], told: bool, tmp_path: Path
) -> None:
    """The first request of a prefix goes anywhere; the instance that ran it publishes its
    blocks; every later request with that prefix goes there. Told where each instance
    publishes (`--kv-event-source`), or finding it itself (`/kv_event_sources`)."""
    urls = [i.server.url for i in fleet]
    options: dict[str, Any] = {"policy": "kv_aware"}
    if told:
        options["kv_events"] = {i.server.url: i.events for i in fleet}
        options["kv_replay"] = {i.server.url: i.replay for i in fleet}
        options["model"] = MODEL
    prefix = f"{PREFIX} Case {'told' if told else 'discovered'}."
    with running_router(urls, tmp_path / "router.log", **options) as url:
        client = _client(url)
        before = [_served(i) for i in fleet]
        _completion(client, f"{prefix} Question 0:")
        first = [_served(i) - b for i, b in zip(fleet, before, strict=True)]
        holder = first.index(1)
        time.sleep(0.5)  # the step's events reach the router
        for n in range(1, 5):
            _completion(client, f"{prefix} Question {n}:")
        client.close()
    after = [_served(i) - b for i, b in zip(fleet, before, strict=True)]
    assert after[holder] == 5 and sum(after) == 5, (after, tmp_path / "router.log")


def test_kv_aware_over_a_data_parallel_instance_sends_a_prefix_to_its_rank(
    tmp_path: Path,
) -> None:
    """An instance with two engine cores publishes each one's events on its own port; the
    router, told both, sends a prefix's later requests to the rank holding it (its
    X-data-parallel-rank header), so all of them hit the cache there."""
    pub = free_port()
    while free_port() != pub + 1:  # rank 1 binds the next port
        pub = free_port()
    args = [*ARGS, "-dp", "2", "--kv-events-config", kv_events_config(pub)]
    with running_servers((args, tmp_path / "dp.log", None)) as [server]:
        sources = f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{pub + 1}"
        with running_router(
            [server.url], tmp_path / "router.log", policy="kv_aware",
            kv_events={server.url: sources}, model=MODEL,
            extra=["--intra-node-data-parallel-size", "2"],
        ) as url:  # fmt: skip
            client = _client(url)
            _completion(client, f"{PREFIX} Case dp. Question 0:")
            time.sleep(0.5)
            before = _hits(server.url)
            for n in range(1, 5):
                _completion(client, f"{PREFIX} Case dp. Question {n}:")
            client.close()
        blocks = (len(_tokens(server.url, f"{PREFIX} Case dp.")) // 16) * 16
        assert _hits(server.url) - before >= 4 * blocks - 16 * 4, (before, _hits(server.url))


def _hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        map(float, re.findall(r"^triode:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))
    )


def _tokens(url: str, text: str) -> list[int]:
    answer = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10).json()
    return list(answer["tokens"])


def _rejoins(client: openai.OpenAI, url: str, within: float = 30.0) -> bool:
    """Whether requests through the router (`client`) reach the instance at `url` again
    within `within` seconds, as its health checks see it up."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        before = _served_at(url)
        _completion(client, "Again:")
        if _served_at(url) > before:
            return True
        time.sleep(0.5)
    return False


def _served_at(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(map(float, re.findall(r"^triode:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


@contextlib.contextmanager
def _instance_on(port: int, args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "serve", *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_health(process, f"http://127.0.0.1:{port}", log, START_TIMEOUT)
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def test_an_instance_killed_under_load_is_routed_around_and_rejoins(
    fleet: list[Instance], tmp_path: Path
) -> None:
    """One of the fleet and a third instance behind the router under load; the third is
    killed (its whole process group): its whole answers in flight are retried by the router,
    its streams in flight end with an error, none of the others is lost, later requests go to
    the survivor; started again on its port, it gets requests again."""
    port = free_port()
    args, _, _ = _instance_args()
    log = tmp_path / "victim.log"
    survivor = fleet[0]
    victim_url = f"http://127.0.0.1:{port}"
    urls = [survivor.server.url, victim_url]
    with (
        _instance_on(port, args, log) as victim,
        running_router(urls, tmp_path / "router.log", policy="round_robin") as url,
    ):
        results: dict[str, list[str]] = {"whole": [], "streamed": []}

        async def one(i: int, stream: bool) -> None:
            body = {"model": MODEL, "prompt": f"Count from {i}:", "max_tokens": 64,
                    "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip
            async with httpx.AsyncClient(timeout=120) as http:
                try:
                    if not stream:
                        answer = await http.post(f"{url}/v1/completions", json=body)
                        results["whole"].append(str(answer.status_code))
                        return
                    async with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
                        text = b"".join([chunk async for chunk in answer.aiter_bytes()])
                    ended = text.rstrip().endswith(b"data: [DONE]")
                    results["streamed"].append("done" if ended else "cut")
                except httpx.HTTPError as e:
                    results["streamed" if stream else "whole"].append(type(e).__name__)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i, i % 2 == 1)
            await trio.sleep(1.0)
            os.killpg(victim.pid, signal.SIGKILL)
        # A whole answer in flight on the victim is retried by the router on the survivor;
        # a stream in flight there ends cut short (no [DONE]) or with a transport error;
        # nothing hangs. (Which streams the victim had depends on the interleaving.)
        assert results["whole"] == ["200"] * 4, results
        assert len(results["streamed"]) == 4, results
        await trio.sleep(2.5)  # a failed health check or two
        client = _client(url)
        for n in range(4):
            assert await trio.to_thread.run_sync(_completion, client, f"After {n}:")
        victim.wait()
        with _instance_on(port, args, log):
            assert await trio.to_thread.run_sync(_rejoins, client, victim_url)
        client.close()
