"""Disaggregated prefill end to end on the default model: two prefill `triode serve` instances
(one per transport: TCP and shared memory), a decode instance and `triode proxy` between them,
all real processes on loopback, driven with the openai client.

Greedy float32 output through the proxy must equal Hugging Face transformers (what a colocated
instance is pinned to by test_engine.py), the decode instance must compute only each prompt's
last token (its `prompt_tokens_by_source` metrics), and both sides must end with nothing
running and no KV block in use.

The instances and the proxy share a deployment secret; hostile requests (params made for
another prompt, unsealed, forged, expired or another deployment's params, a client's own
`do_remote_decode`) are refused with a 400 and leave every instance healthy and idle.
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
from typing import Any

import httpx
import openai
import pytest
import trio
from kv_secret import secret_file
from reference import Reference
from router import pd_router_command, running_router_command
from server import Server, free_port, running_server, running_servers, wait_for_health

from triode.wire.kv_seal import read_secret, seal, seal_remote_decode

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who loved to",
    "Here is a list of the planets of the solar system, from the sun outwards:",
]
NEW_TOKENS = 12
# the key vllm-router sends the instances (its OPENAI_API_KEY)
ROUTER_KEY = "router-key"
ROUTER_KEY_ARGS = ["--api-key", ROUTER_KEY]
F32 = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB",
       "--served-model-name", "m"]  # fmt: skip


def _kv(role: str, secret: str, transport: str = "tcp", **extra: float | str) -> list[str]:
    config = {
        "kv_connector": "TriodeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"transport": transport, "secret_file": secret, **extra},
    }
    return ["--kv-transfer-config", json.dumps(config)]


@contextlib.contextmanager
def running_proxy(prefill: list[str], decode: list[str], secret: str, log: Path) -> Iterator[str]:
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "triode.edge.cli", "proxy", "--port", str(port),
             "--prefill", *prefill, "--decode", *decode, "--kv-secret-file", secret],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(process, url, log, 30, poll=0.1)
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
def secret(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The deployment's secret file, shared by the instances and the proxy."""
    return secret_file(tmp_path_factory.mktemp("secret"))


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory, secret: str) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd")
    with running_servers(
        ([*F32, *_kv("kv_producer", secret, "tcp")], logs / "tcp.log", None),
        ([*F32, *_kv("kv_producer", secret, "shm")], logs / "shm.log", None),
        ([*F32, *_kv("kv_consumer", secret, load_timeout=3.0)], logs / "d.log", None),
        (
            [*F32, *_kv("kv_producer", secret, unsealed_holds="authenticated"), *ROUTER_KEY_ARGS],
            logs / "routed.log",
            None,
        ),
    ) as [tcp, shm, decode, routed]:
        yield {"tcp": tcp, "shm": shm, "decode": decode, "routed": routed}


@pytest.fixture(scope="module")
def proxy(
    instances: dict[str, Server], secret: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    prefill = [instances["tcp"].url, instances["shm"].url]
    with running_proxy(prefill, [instances["decode"].url], secret, log) as url:
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
    failures = "triode:kv_transfer_failures_total"
    assert after[failures] == before[failures]  # none in this test (another's may come first)
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


def _prefill(prefill: Server, prompt: str, secret: str) -> dict[str, Any]:
    """The params a prefill hands on for `prompt`, asked for as the proxy asks."""
    asked = seal_remote_decode(read_secret(secret), {"do_remote_decode": True})
    answer = httpx.post(
        f"{prefill.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": asked},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["seal"]
    return params


def _complete(server: Server, prompt: str, params: Any = None) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _refused(response: httpx.Response, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and says in error["message"], error


def test_params_made_for_one_prompt_are_refused_with_another_and_poison_no_cache(
    instances: dict[str, Server], reference: Reference, secret: str
) -> None:
    """The live attack: a prefill's params for prompt A sent to the decode with prompt B (of
    as many tokens) loaded A's KV into the prefix cache under B's hashes, and later requests
    starting with B, from anyone, were answered from A's KV."""
    prefill, decode = instances["tcp"], instances["decode"]
    tale = " they all lived happily ever after in the little house by the old mill near the river"
    prompt_a = "Once upon a time, in a land far away, there lived a dragon who loved to eat apples "
    prompt_b = "Once upon a time, in a town far away, there lived a farmer who loved to eat apples "
    prompt_a += "and sing songs about the sea, and" + tale  # 45 tokens: 2 full blocks and a part
    prompt_b += "and sing songs about the war, and" + tale
    ids_a, ids_b = reference.encode(prompt_a), reference.encode(prompt_b)
    assert len(ids_a) == len(ids_b)  # the token count, which was all that was compared
    expected_b = reference.tokenizer.decode(reference.greedy(tuple(ids_b), NEW_TOKENS))
    params_a = _prefill(prefill, prompt_a, secret)
    _refused(_complete(decode, prompt_b, params_a), "made for another prompt")
    for _ in range(2):  # the second is answered from the prefix cache, if anything is in it
        answer = _complete(decode, prompt_b)
        assert answer.json()["choices"][0]["text"] == expected_b
    # the params still serve their own prompt, which frees the prefill's hold
    expected_a = reference.tokenizer.decode(reference.greedy(tuple(ids_a), NEW_TOKENS))
    loaded = _complete(decode, prompt_a, params_a)
    assert loaded.json()["choices"][0]["text"] == expected_a
    _settle(prefill, decode)


def test_unsealed_forged_expired_and_foreign_params_are_a_400(
    instances: dict[str, Server], secret: str
) -> None:
    prefill, decode = instances["shm"], instances["decode"]
    params = _prefill(prefill, PROMPTS[0], secret)
    unsealed = {k: v for k, v in params.items() if k != "seal"}
    digest = params["prompt_digest"]
    other = b"another deployment's secret, 32+ bytes"
    for forged, says in [
        (unsealed, "not sealed"),
        ({**params, "remote_block_ids": [b + 1 for b in params["remote_block_ids"]]}, "seal"),
        ({**params, "remote_endpoints": ["tcp://10.0.0.1:5000"]}, "seal"),
        ({**params, "remote_secret": "guess"}, "seal"),
        (seal(other, unsealed, digest, ttl=60), "seal"),
        (seal(read_secret(secret), unsealed, digest, ttl=1, now=time.time() - 3600), "expired"),
        ({**params, "remote_num_tokens": 2**80}, "64-bit"),
        ({**params, "remote_block_ids": [2**64]}, "64-bit"),
        ({**params, "extra": {"nested": [1]}}, "extra"),
    ]:
        _refused(_complete(decode, PROMPTS[0], forged), says)
    loaded = _complete(decode, PROMPTS[0], params)  # the genuine ones free the hold
    assert loaded.status_code == 200
    _settle(prefill, decode)


def test_a_clients_own_do_remote_decode_is_a_400_at_the_prefill(
    instances: dict[str, Server],
) -> None:
    """Only the deployment's proxy may make a prefill instance hold blocks."""
    prefill = instances["tcp"]
    other = seal_remote_decode(
        b"another deployment's secret, 32+ bytes", {"do_remote_decode": True}
    )
    for asked, says in [({"do_remote_decode": True}, "not sealed"), (other, "seal")]:
        response = httpx.post(
            f"{prefill.url}/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": 1, "kv_transfer_params": asked},
            timeout=30,
        )
        _refused(response, says)
    _settle(prefill)
    for server in instances.values():
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_through_vllm_router_equals_transformers_and_the_decode_computes_one_token(
    instances: dict[str, Server], expected: list[str], tmp_path: Path
) -> None:
    """vllm-router's P/D mode: its prefill leg asks for a hold without the proxy's seal, and
    the prefill instance, whose KV config takes an authenticated caller's word for it
    (`unsealed_holds: authenticated`), seals it itself; the decode still checks the seal the
    prefill returns."""
    prefill, decode = instances["routed"], instances["decode"]
    before = _metrics(decode)
    port = free_port()
    command = pd_router_command(prefill.url, decode.url, port)
    env = {"OPENAI_API_KEY": ROUTER_KEY}
    with running_router_command(command, port, tmp_path / "router.log", env=env) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        texts = []
        for prompt in PROMPTS:
            out = client.completions.create(
                model="m", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts.append(out.choices[0].text)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=NEW_TOKENS, temperature=0, stream=True,
        )  # fmt: skip
        with stream:
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        client.close()
    assert texts == expected
    assert streamed
    after = _metrics(decode)
    computed = "triode:prompt_tokens_by_source_total/local_compute"
    assert after[computed] - before[computed] == len(PROMPTS) + 1  # each prompt's last token
    transferred = "triode:prompt_tokens_by_source_total/external_kv_transfer"
    assert after[transferred] > before[transferred]
    _settle(prefill, decode)


def test_an_unsealed_hold_needs_the_key_and_the_instances_consent(
    instances: dict[str, Server],
) -> None:
    """What a prefill takes from a router: with `unsealed_holds: authenticated` and the key,
    its own seal on the params it returns; without the key a 401; an instance that did not
    consent refuses the unsealed params (the test above the proxy's)."""
    routed = instances["routed"]
    body = {"prompt": PROMPTS[1], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": None}}  # fmt: skip
    assert httpx.post(f"{routed.url}/v1/completions", json=body, timeout=30).status_code == 401
    answer = httpx.post(
        f"{routed.url}/v1/completions", json=body, timeout=30,
        headers={"authorization": f"Bearer {ROUTER_KEY}"},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["seal"]
    # the hold is released by its expiry or a decode's DONE; none comes here: free it by
    # loading it once
    loaded = _complete(instances["decode"], PROMPTS[1], params)
    assert loaded.status_code == 200
    _refused(_complete(instances["tcp"], PROMPTS[1], {"do_remote_decode": True}), "not sealed")
    _settle(routed, instances["decode"])


def test_a_kv_instance_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    loose = tmp_path / "kv.secret"
    loose.write_text("0123456789abcdef" * 4)
    loose.chmod(0o644)
    for extra, says in [
        ({}, "secret_file is required"),
        ({"secret_file": str(loose)}, "chmod 600"),
        ({"secret_file": str(tmp_path / "absent")}, "make one with"),
    ]:
        config = {"kv_connector": "TriodeConnector", "kv_role": "kv_consumer",
                  "kv_connector_extra_config": extra}  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "triode.edge.cli", "serve", "--port", "0",
             "--kv-transfer-config", json.dumps(config)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("triode serve: ") and says in line


def test_a_prefill_killed_before_the_transfer_makes_the_decode_recompute(
    instances: dict[str, Server], expected: list[str], secret: str, tmp_path: Path
) -> None:
    """It kills a TCP prefill instance of its own: the module's stay as the other tests need
    them, in whatever order they run."""
    decode = instances["decode"]
    with running_server([*F32, *_kv("kv_producer", secret, "tcp")], tmp_path / "p.log") as prefill:
        _killed_prefill_makes_the_decode_recompute(prefill, decode, expected, secret)


def _killed_prefill_makes_the_decode_recompute(
    prefill: Server, decode: Server, expected: list[str], secret: str
) -> None:
    params = _prefill(prefill, PROMPTS[2], secret)
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
