"""`triode serve` end to end: a real server process on the real default model, driven by the
official `openai` client and by raw HTTP for streams that disconnect or outlive the engine."""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEYS, SERVED_NAME
from server import Server, running_server

from triode.edge.sse import SSEParser

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
KEY = API_KEYS[0]
_AUTH = {"authorization": f"Bearer {KEY}"}


def _client(server: Server, root: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}{root}/v1", api_key=KEY, max_retries=0)


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("triode:") and "{" in line:
            name = line.split("{", 1)[0]
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def _wait_until_idle(server: Server, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["triode:num_requests_running"] == 0 and m["triode:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_chat_stream_equals_non_stream(server: Server) -> None:
    client = _client(server, "/api")
    whole = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_tokens=24, temperature=0
    )
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [choice.finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    # the same prompt again: its full blocks came from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens >= 16
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"messages": QUESTION}, headers=_AUTH, timeout=10
    )
    prompt = tokenized.json()["count"]
    assert whole.usage.prompt_tokens == prompt
    assert whole.usage.total_tokens == prompt + whole.usage.completion_tokens


def test_completions_stream_and_usage(server: Server) -> None:
    client = _client(server)
    prompt = "The capital of France is"
    whole = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert streamed[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    echoed = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert echoed.choices[0].text == prompt + whole.choices[0].text


def test_n_and_seed(server: Server) -> None:
    client = _client(server)
    kwargs = {"model": SERVED_NAME, "messages": QUESTION, "max_tokens": 16, "temperature": 1.0}
    first = client.chat.completions.create(n=2, seed=7, **kwargs)
    again = client.chat.completions.create(n=2, seed=7, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    total = sum(_count_tokens(server, c.message.content) for c in first.choices)
    # re-tokenized text may merge differently at most a little; the count is the engine's
    assert abs(first.usage.completion_tokens - total) <= 4


def _count_tokens(server: Server, text: str) -> int:
    body = {"prompt": text}
    response = httpx.post(f"{server.url}/tokenize", json=body, headers=_AUTH, timeout=10)
    return int(response.json()["count"])


def test_stop_string(server: Server) -> None:
    client = _client(server)
    kwargs = {"model": SERVED_NAME, "prompt": "One, two, three, four, five,", "temperature": 0}
    free = client.completions.create(max_tokens=24, **kwargs).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    stopped = client.completions.create(max_tokens=24, stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop)]
    assert stopped.model_extra["stop_reason"] == stop


def test_logprobs(server: Server) -> None:
    client = _client(server)
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    completion = client.completions.create(
        model=SERVED_NAME, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_models(server: Server) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]


# cache_salt, and the fixture's --prefix-cache-isolation key: a prefix-cache hit shows in
# usage.prompt_tokens_details.cached_tokens (and in the time to the first token), so a caller
# who could hit another's blocks could tell what that one sent.


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None) or getattr(
        usage, "input_tokens_details", None
    )
    return (details.cached_tokens or 0) if details is not None else 0


def _salted(client: openai.OpenAI, route: str, text: str, salt: str | None) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of one request on `route`."""
    extra = {} if salt is None else {"cache_salt": salt}
    if route == "completions":
        usage = client.completions.create(
            model=SERVED_NAME, prompt=text, max_tokens=1, temperature=0, extra_body=extra
        ).usage
        return _cached(usage), usage.prompt_tokens
    if route == "chat":
        usage = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": text}], max_tokens=1,
            temperature=0, extra_body=extra,
        ).usage  # fmt: skip
        return _cached(usage), usage.prompt_tokens
    usage = client.responses.create(
        model=SERVED_NAME, input=text, max_output_tokens=1, store=False, extra_body=extra
    ).usage
    return _cached(usage), usage.input_tokens


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_cached_prompt_blocks_are_shared_only_under_one_key_and_one_salt(
    server: Server, route: str
) -> None:
    alice = _client(server)
    bob = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEYS[1], max_retries=0)
    text = f"{uuid.uuid4().hex} {route}: " + "The quick brown fox jumps over the lazy dog. " * 6

    def shared(client: openai.OpenAI, salt: str | None) -> bool:
        """Whether the whole prompt (its full blocks but the last token's) was cached; a
        chat template's opening may be, from earlier requests of the same tenant and salt."""
        cached, prompt = _salted(client, route, text, salt)
        whole = (prompt - 1) // 16 * 16
        assert cached <= whole and cached % 16 == 0, (cached, prompt)
        return cached == whole

    assert not shared(alice, "s1")  # nobody sent it yet
    assert shared(alice, "s1")  # the same key and salt: its blocks
    assert not shared(alice, "s2")  # another salt
    assert not shared(alice, None)  # no salt is a salt of its own
    # another key sees none of those, salt or not, and shares its own blocks
    assert not shared(bob, "s1")
    assert not shared(bob, None)
    assert shared(bob, None)


@pytest.mark.parametrize("route", ["completions", "chat/completions", "responses"])
@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(server: Server, route: str, salt: object) -> None:
    body: dict[str, Any] = {"model": SERVED_NAME, "cache_salt": salt, "max_tokens": 1}
    if route == "completions":
        body["prompt"] = "hi"
    elif route == "chat/completions":
        body["messages"] = QUESTION
    else:
        body = {"model": SERVED_NAME, "input": "hi", "cache_salt": salt}
    answer = httpx.post(f"{server.url}/v1/{route}", json=body, headers=_AUTH, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "cache_salt"


def _stream_request(server: Server, max_tokens: int) -> tuple[str, dict]:
    body = {
        "model": SERVED_NAME, "prompt": "Tell me a very long story.", "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    return f"{server.url}/v1/completions", body


def test_disconnect_mid_stream_frees_everything(server: Server) -> None:
    url, body = _stream_request(server, max_tokens=1500)
    before = _metrics(server)["triode:generation_tokens_total"]
    headers = {"Authorization": f"Bearer {KEY}"}
    for _ in range(2):
        with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
            assert response.status_code == 200
            parser, events = SSEParser(), []
            for chunk in response.iter_bytes():
                events += parser.feed(chunk)
                if len(events) >= 3:
                    break  # leaving the block closes the connection mid-stream
    m = _wait_until_idle(server)
    assert m["triode:num_requests_running"] == 0
    assert m["triode:kv_cache_usage_perc"] == 0
    # aborted, not run to the end: far fewer than 2 x 1500 tokens were generated
    assert m["triode:generation_tokens_total"] - before < 1500


def test_disconnect_while_waiting_for_a_whole_answer(server: Server) -> None:
    url, body = _stream_request(server, max_tokens=1500)
    body["stream"] = False
    del body["stream_options"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    m = _wait_until_idle(server)
    assert m["triode:num_requests_running"] == 0
    assert m["triode:kv_cache_usage_perc"] == 0


def test_sigterm_drains_in_flight_streams(model_dir: Path, tmp_path: Path) -> None:
    with running_server(["--max-model-len", "2048"], tmp_path / "serve.log") as server:
        url = f"{server.url}/v1/completions"
        body = {"prompt": "Count to ten:", "max_tokens": 48, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            parser = SSEParser()
            stream = response.iter_bytes()
            events = parser.feed(next(stream))
            server.process.send_signal(signal.SIGTERM)
            for chunk in stream:
                events += parser.feed(chunk)
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 48
        assert server.process.wait(30) == 0
        assert "shutting down" in server.output()


def test_cors_only_for_allowed_origins(tmp_path: Path) -> None:
    args = ["tiny-random", "--allowed-origins", "https://app.example", "--api-key", KEY]
    with running_server(args, tmp_path / "serve.log") as server:
        preflight = httpx.options(
            f"{server.url}/v1/chat/completions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"

        allowed = httpx.get(
            f"{server.url}/v1/models",
            headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"},
        )
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"

        other = httpx.get(
            f"{server.url}/v1/models",
            headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"},
        )
        assert "access-control-allow-origin" not in other.headers
        # a preflight is open, the request behind it is not
        denied = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})
        assert denied.status_code == 401
