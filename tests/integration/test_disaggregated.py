"""Disaggregated prefill end to end on the default model: two prefill `triode serve` instances
(one per transport: TCP and shared memory), a decode instance and `triode proxy` between them,
all real processes on loopback, driven with the openai client.

Greedy float32 output through the proxy must equal Hugging Face transformers (what a colocated
instance is pinned to by test_engine.py), the decode instance must compute only each prompt's
last token (its `prompt_tokens_by_source` metrics), and both sides must end with nothing
running and no KV block in use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from reference import Reference
from server import Server, free_port, running_server

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who loved to",
    "Here is a list of the planets of the solar system, from the sun outwards:",
]
NEW_TOKENS = 12
F32 = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB",
       "--served-model-name", "m"]  # fmt: skip


def _kv(role: str, transport: str = "tcp", **extra: float) -> list[str]:
    config = {
        "kv_connector": "TriodeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, **extra},
    }
    return ["--kv-transfer-config", json.dumps(config)]


@contextlib.contextmanager
def running_proxy(prefill: list[str], decode: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "proxy", "--port", str(port),
             "--prefill", *prefill, "--decode", *decode],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"(triode:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if match:
            name, labels, value = match.groups()
            source = re.search(r'source="([a-z_]+)"', labels or "")
            values[f"{name}/{source.group(1)}" if source else name] = float(value)
    return values


def _settle(*servers: Server, timeout: float = 20.0) -> None:
    """Wait for every server to run nothing and hold no KV block."""
    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            m = _metrics(server)
            idle = m["triode:num_requests_running"] == 0 and m["triode:kv_cache_usage_perc"] == 0
            if idle:
                break
            assert time.monotonic() < deadline, f"{server.url} never settled: {m}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd")
    with (
        running_server([*F32, *_kv("kv_producer", "tcp")], logs / "tcp.log") as tcp,
        running_server([*F32, *_kv("kv_producer", "shm")], logs / "shm.log") as shm,
        running_server([*F32, *_kv("kv_consumer", load_timeout=3.0)], logs / "d.log") as decode,
    ):
        yield {"tcp": tcp, "shm": shm, "decode": decode}


@pytest.fixture(scope="module")
def proxy(instances: dict[str, Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    prefill = [instances["tcp"].url, instances["shm"].url]
    with running_proxy(prefill, [instances["decode"].url], log) as url:
        yield url


@pytest.fixture(scope="module")
def expected(reference: Reference) -> list[str]:
    ids = [reference.greedy(tuple(reference.encode(p)), NEW_TOKENS) for p in PROMPTS]
    return [reference.tokenizer.decode(e) for e in ids]


def test_through_the_proxy_equals_transformers_and_the_decode_computes_one_token(
    instances: dict[str, Server], proxy: str, expected: list[str]
) -> None:
    decode = instances["decode"]
    before = _metrics(decode)
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
    texts = []
    for prompt in PROMPTS:  # round-robin: the TCP and the shm prefill take turns
        out = client.completions.create(
            model="m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts.append(out.choices[0].text)
    client.close()
    assert texts == expected
    after = _metrics(decode)
    computed = after["triode:prompt_tokens_by_source_total/local_compute"]
    assert computed - before["triode:prompt_tokens_by_source_total/local_compute"] == len(PROMPTS)
    transferred = after["triode:prompt_tokens_by_source_total/external_kv_transfer"]
    assert transferred > before["triode:prompt_tokens_by_source_total/external_kv_transfer"]
    assert after["triode:kv_transfer_failures_total"] == 0
    for name in ("tcp", "shm"):
        assert _metrics(instances[name])["triode:prompt_tokens_by_source_total/local_compute"] > 0
    _settle(instances["tcp"], instances["shm"], decode)


async def test_concurrent_streams_through_the_proxy(
    instances: dict[str, Server], proxy: str, expected: list[str]
) -> None:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
        )
        with stream:
            texts[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(trio.to_thread.run_sync, one, i)
    client.close()
    # the same prompt gives the same answer whichever prefill instance took it
    for i in range(len(PROMPTS)):
        assert texts[i] == texts[i + len(PROMPTS)] and texts[i]
    _settle(instances["tcp"], instances["shm"], instances["decode"])


def test_an_aborted_decode_frees_both_sides(instances: dict[str, Server], proxy: str) -> None:
    body = {"prompt": PROMPTS[3], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proxy}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # streaming has begun: then the client goes
    _settle(instances["tcp"], instances["shm"], instances["decode"])


def test_bad_transfer_params_are_a_400(instances: dict[str, Server]) -> None:
    decode = instances["decode"]
    for params, field in [
        ({"do_remote_prefill": True}, "remote_engine_id"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclude"),
    ]:
        response = httpx.post(
            f"{decode.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": params},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert field in error["message"] and error["param"] == "kv_transfer_params"


def test_a_prefill_killed_before_the_transfer_makes_the_decode_recompute(
    instances: dict[str, Server], expected: list[str]
) -> None:
    """Last in the module: it kills the TCP prefill instance."""
    prefill, decode = instances["tcp"], instances["decode"]
    first = httpx.post(
        f"{prefill.url}/v1/completions",
        json={
            "prompt": PROMPTS[2],
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=60,
    ).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    engine = prefill.engine_pid()
    prefill.process.kill()
    os.kill(engine, signal.SIGKILL)
    prefill.process.wait()
    failures = _metrics(decode)["triode:kv_transfer_failures_total"]
    answer = httpx.post(
        f"{decode.url}/v1/completions",
        json={"prompt": PROMPTS[2], "max_tokens": NEW_TOKENS, "temperature": 0,
              "ignore_eos": True, "kv_transfer_params": params},
        timeout=60,
    ).json()  # fmt: skip
    assert answer["choices"][0]["text"] == expected[2]
    assert _metrics(decode)["triode:kv_transfer_failures_total"] == failures + 1
    _settle(decode)
