"""Weights from a trainer into a real `triode serve` of two tensor-parallel ranks: the README's
`WeightSyncClient` example runs as written, each backend replaces every weight of both ranks
(greedy fp32 output turns into another model's, then back into the first's exactly), and no
segment is left behind."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server import Server, running_server, wait_for_health
from shm_segments import no_segment_outlives_a_test  # noqa: F401 - autouse

from triode.gpu.weight_transfer.client import WeightSyncClient, WeightSyncError

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
KEY = "trainer-key"
PROMPT = "The weights of this model are"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("weight-sync") / "serve.log"
    # two tensor-parallel ranks: each keeps its own shard of what comes
    command = ["tiny-random", "--api-key", KEY, "--dtype", "float32", "--enable-admin-api"]
    command += ["--tensor-parallel-size", "2"]
    with running_server(command, log) as s:
        yield s


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """The served model as transformers loads it, and another of its architecture with other
    random weights."""
    # transformers takes seconds to import, and only this fixture needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    from triode.gpu.loader import tiny_random

    served = AutoModelForCausalLM.from_pretrained(tiny_random(), dtype=torch.float32)
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_random()))
    return served, other.to(torch.float32)


def _greedy(server: Server) -> str:
    headers = {"Authorization": f"Bearer {KEY}"}
    [model] = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"]
    body = {"model": model["id"], "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    answer.raise_for_status()
    return answer.json()["choices"][0]["text"]


def _readme_example() -> str:
    section = README.read_text().split("### Weights from a trainer", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S)
    assert example is not None
    return example.group(1)


def test_the_readme_example_and_the_broadcast_each_replace_every_weight(
    server: Server, models: tuple[Any, Any]
) -> None:
    served, other = models
    first = _greedy(server)
    code = _readme_example().replace("http://127.0.0.1:8000", server.url)
    scope: dict[str, Any] = {"model": other}
    exec(code.replace('api_key="KEY"', f"api_key={KEY!r}"), scope)  # the shm backend
    shm_version = scope["version"]
    assert _greedy(server) != first
    with WeightSyncClient(
        server.url, api_key=KEY, backend="broadcast", bucket_bytes=64 << 10, timeout=60
    ) as client:
        assert client.update(served.named_parameters()) == shm_version + 1
    assert _greedy(server) == first


def test_a_refused_bucket_changes_nothing(server: Server, models: tuple[Any, Any]) -> None:
    _, other = models
    before = _greedy(server)
    named = dict(other.named_parameters())
    name = next(iter(named))
    with WeightSyncClient(server.url, api_key=KEY, backend="shm") as client:
        client.start()
        with pytest.raises(WeightSyncError) as caught:
            client.send([*named.items(), (name + ".extra", torch.zeros(3))])
        assert caught.value.status == 400
        assert name + ".extra" in caught.value.message
        client.finish()
    assert _greedy(server) == before


def test_a_restart_after_a_push_serves_the_weights_on_disk_as_a_new_version(
    server: Server, models: tuple[Any, Any]
) -> None:
    """A trainer's weights live only in the engine core's ranks: when it dies, the one started
    in its place serves the weights on disk, under a new weight_version, and says so. One that
    dies in its turn hands on the same weights and version: nothing more was lost."""
    _, other = models
    on_disk = _greedy(server)
    with WeightSyncClient(server.url, api_key=KEY, backend="shm") as client:
        pushed = client.update(other.named_parameters())
    assert _greedy(server) != on_disk
    headers = {"Authorization": f"Bearer {KEY}"}
    dead = server.engine_pid()
    for restart in (1, 2):
        os.kill(dead, signal.SIGKILL)
        dead = server.restarted_engine_pid(restart)
        wait_for_health(server.process, server.url, server.log, 120)
        assert _greedy(server) == on_disk
        [model] = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"]
        assert model["weight_version"] == pushed + 1
    said = f"the weights a trainer pushed (weight_version {pushed}) cannot be recovered"
    assert server.output().count(said) == 1
