"""`triode serve --api-server-count 2 --data-parallel-size 2` on the default model: two API
server processes on one port over two engine cores."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from processes import actor_processes, alive, established_to
from server import Server, running_server

from triode.actors.forkserver import Forkserver

pytestmark = pytest.mark.slow

MODEL = "smol"
PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def scaled(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("scaled") / "serve.log"
    args = ["--api-server-count", "2", "--data-parallel-size", "2", "--dtype", "float32",
            "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
            "--served-model-name", MODEL]  # fmt: skip
    with running_server(args, log) as server:
        yield server
    assert not any(alive(pid) for pid in server.children_seen), server.output()


@pytest.fixture
def children(scaled: Server, forkserver: Forkserver) -> Callable[[], dict[str, int]]:
    """The server's actors by name (`api-server-0`, `engine-core-1`, ...), as they are now."""
    return lambda: actor_processes(scaled.process.pid, forkserver.pid)


@pytest.fixture
def client(scaled: Server, children: Callable[[], dict[str, int]]) -> Iterator[openai.OpenAI]:
    scaled.children_seen = getattr(scaled, "children_seen", set()) | set(  # type: ignore[attr-defined]
        children().values()
    )
    with openai.OpenAI(base_url=f"{scaled.url}/v1", api_key="none", max_retries=0) as client:
        yield client


def _streamed(server: Server, prompt: str) -> tuple[str, str | None]:
    """A streamed completion's text and finish reason, on a connection of its own."""
    with _fresh(server) as client:
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_both_api_servers_serve_and_each_stream_gets_only_its_own_tokens(
    scaled: Server, client: openai.OpenAI, children: Callable[[], dict[str, int]]
) -> None:
    found = children()
    assert sorted(found) == ["api-server-0", "api-server-1", "engine-core-0", "engine-core-1"]
    edges = [found["api-server-0"], found["api-server-1"]]
    before = [_cpu_seconds(pid) for pid in edges]
    served = _metric(scaled, "triode:request_success_total")
    model = MODEL
    # a connection per request: the kernel spreads them over both processes by their ports
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streamed = list(pool.map(lambda p: _streamed(scaled, p), PROMPTS))
    after = [_cpu_seconds(pid) for pid in edges]
    whole = [
        client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0]
        for p in PROMPTS
    ]
    assert streamed == [(c.text, c.finish_reason) for c in whole]
    assert (
        len({c.text for c in whole}) > 1
    )  # distinct prompts, distinct answers: no stream took another's
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)
    # each scrape is answered by one process, with every process's counts
    assert _metric(scaled, "triode:request_success_total") == served + 2 * len(PROMPTS)


def _fresh(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        max_retries=0,
        http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)),
    )


def test_a_killed_api_server_is_replaced_and_its_requests_freed(
    scaled: Server, client: openai.OpenAI, children: Callable[[], dict[str, int]]
) -> None:
    victim = children()["api-server-1"]

    def long_stream(first_chunk: threading.Event) -> str:
        try:
            with _fresh(scaled) as fresh:
                stream = fresh.completions.create(
                    model=MODEL, prompt="Count:", max_tokens=120, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                chunks = 0
                for _ in stream:
                    chunks += 1
                    first_chunk.set()
                return "done" if chunks > 100 else "short"
        except (openai.APIError, httpx.HTTPError):
            return "failed"
        finally:
            first_chunk.set()

    # The kernel hands each connection to either API server: streams are opened until each
    # server holds at least one (six at least, 24 at most), so that some survive the kill.
    port = int(scaled.url.rsplit(":", 1)[1])
    servers = [children()[f"api-server-{i}"] for i in (0, 1)]
    with ThreadPoolExecutor(24) as pool:
        futures = []
        deadline = time.monotonic() + 60
        while len(futures) < 6 or not all(established_to(pid, port) for pid in servers):
            assert len(futures) < 24 and time.monotonic() < deadline
            first_chunk = threading.Event()
            futures.append(pool.submit(long_stream, first_chunk))
            assert first_chunk.wait(30)
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    assert "done" in outcomes and set(outcomes) <= {"done", "failed", "short"}, outcomes
    deadline = time.monotonic() + 30
    while (new := children().get("api-server-1")) in (None, victim):
        assert time.monotonic() < deadline, scaled.output()
        time.sleep(0.2)
    # the dead edge's requests were aborted in the engines: nothing is left running
    deadline = time.monotonic() + 30
    while _metric(scaled, "triode:num_requests_running"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _streamed(scaled, p), PROMPTS))
    assert all(reason in ("stop", "length") for _, reason in answers), answers
    assert alive(new) and not alive(victim)
    assert "API server 1 died" in scaled.output()


def test_health_answers_on_every_connection(scaled: Server) -> None:
    # each a connection of its own, which the kernel hands to either API server
    answers = [httpx.get(f"{scaled.url}/health", timeout=10).status_code for _ in range(20)]
    assert answers == [200] * 20


def test_prompt_embeds_complete_as_the_prompt_s_token_ids_do(
    client: openai.OpenAI, model_dir: Path
) -> None:
    from tokenizers import Tokenizer

    from triode.gpu.gguf_file import packed_weights

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("The capital of").ids
    # the embedding as the server holds it: the GGUF file's rows, dequantized
    embedding = dict(packed_weights(model_dir))["model.embed_tokens.weight"]
    rows = embedding.gather(torch.tensor(ids), torch.float32)
    saved = io.BytesIO()
    torch.save(rows, saved)
    payload = base64.b64encode(saved.getvalue()).decode()

    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    by_embeds = client.completions.create(
        model=MODEL, prompt="", max_tokens=12, temperature=0,
        extra_body={"prompt_embeds": payload},
    )  # fmt: skip
    assert by_embeds.choices[0].text == by_ids.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="prompt_embeds"):
        client.completions.create(
            model=MODEL, prompt="", max_tokens=4,
            extra_body={"prompt_embeds": base64.b64encode(b"not a tensor").decode()},
        )  # fmt: skip
