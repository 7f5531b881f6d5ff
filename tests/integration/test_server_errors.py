"""The HTTP surface of a real `triode serve`, at its edges: every refusal has the right status
and an OpenAI error body naming the offending field, the API keys guard exactly `/v1` (through
the root path and through paths a proxy would normalise), and the small endpoints (/tokenize,
/detokenize, /version, /metrics) answer with real values."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import trio
from conftest import API_KEYS, ROOT_PATH, SERVED_NAME
from prometheus_client.parser import text_string_to_metric_families
from server import Server

pytestmark = pytest.mark.slow

VOCAB_SIZE = 49152  # SmolLM2's
MAX_MODEL_LEN = 2048  # the `server` fixture's --max-model-len
MAX_BODY = 1 << 20  # and its --max-body-size
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello!"}]
# One request of each kind that the server accepts, made as cheap as possible to generate.
BASE = {
    CHAT: {"messages": MESSAGES, "max_tokens": 1},
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 1},
}
LONG_TEXT = "hello " * 3000  # about 3000 tokens: more than MAX_MODEL_LEN on its own
# Small bounds on what a request may cost, so that each is reached with few requests.
MAX_WAITING = 4
STALL_TIMEOUT = 2.0
SERVER_ARGS = [
    "--max-waiting-requests", str(MAX_WAITING), "--health-stall-timeout", str(STALL_TIMEOUT),
    "--max-choices-per-request", "64", "--max-logprob-entries", "10000",
    "--max-prompt-embeds-bytes", "1MiB",
]  # fmt: skip
ANY = object()  # `expect_error`'s "any param"


def expect_error(response: httpx.Response, status: int, *, param: Any = ANY) -> dict[str, Any]:
    """Assert `response` has `status` and an OpenAI error body; return the body's `error`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["code"], int | str)
    if param is not ANY:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    """A client that sends the first API key."""
    headers = {"authorization": f"Bearer {API_KEYS[0]}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def anonymous(server: Server) -> Iterator[httpx.Client]:
    """A client that sends no key."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def raw_get(server: Server, target: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """GET `target` byte for byte: httpx would resolve `..` before sending, http.client does
    not touch the request target."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    try:
        connection.request("GET", target, headers=headers or {})
        response = connection.getresponse()
        return httpx.Response(
            response.status, headers=response.getheaders(), content=response.read()
        )
    finally:
        connection.close()


def count_tokens(client: httpx.Client, **body: Any) -> int:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


def metric_values(client: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics labelled with the served name, by sample name."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.labels == {"model_name": SERVED_NAME}
    }


# Refused request bodies


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_invalid_json_is_400_without_param(client: httpx.Client, path: str) -> None:
    error = expect_error(client.post(path, content=b"{not json}"), 400, param=None)
    assert error["message"].startswith("invalid JSON")
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        (CHAT, {"max_tokens": "x"}, "max_tokens"),
        (CHAT, {"messages": "Hello!"}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
        (CHAT, {"stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"max_tokens": "x"}, "max_tokens"),
        (COMPLETIONS, {"stop": 5}, "stop"),
    ],
)
def test_a_field_of_the_wrong_type_is_400_naming_it(
    client: httpx.Client, path: str, change: dict[str, Any], param: str
) -> None:
    error = expect_error(client.post(path, json={**BASE[path], **change}), 400, param=param)
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_unknown_top_level_field_is_ignored_and_named(client: httpx.Client, path: str) -> None:
    """As vLLM, for the fields routers and gateways add (`edge/ignored_fields.py`); a nested
    one is still a 400."""
    response = client.post(path, json={**BASE[path], "frobnicate": True})
    assert response.status_code == 200, response.text
    assert response.headers["triode-ignored-fields"] == "frobnicate"


def test_empty_messages_are_400(client: httpx.Client) -> None:
    expect_error(client.post(CHAT, json={"messages": []}), 400, param="messages")


@pytest.mark.parametrize("prompt", ["", [], [[]], ["Hello", ""]])
def test_an_empty_prompt_is_400(client: httpx.Client, prompt: Any) -> None:
    response = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
    expect_error(response, 400, param="prompt")


def test_a_missing_prompt_is_400_naming_it(client: httpx.Client) -> None:
    error = expect_error(client.post(COMPLETIONS, json={"max_tokens": 1}), 400, param="prompt")
    assert error["message"] == "prompt: give a prompt, prompt_embeds or both"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 1, "n": 1e9}', "n"),
        (COMPLETIONS, {"n": 1_000_000_000}, "n"),
        (COMPLETIONS, {"n": 0}, "n"),
        (CHAT, {"n": 1_000_000_000}, "n"),
        (COMPLETIONS, {"max_tokens": -1}, "max_tokens"),
        (CHAT, {"max_tokens": -1}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (COMPLETIONS, {"top_p": 2}, "top_p"),
        (CHAT, {"top_p": 2}, "top_p"),
        (COMPLETIONS, {"logprobs": 1000}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        (COMPLETIONS, {"temperature": -1}, "temperature"),
        (CHAT, {"temperature": -1}, "temperature"),
        (COMPLETIONS, {"top_k": -2}, "top_k"),
        (COMPLETIONS, {"presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"seed": 2**64}, "seed"),
    ],
)
def test_an_out_of_range_number_is_400_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any] | bytes, param: str
) -> None:
    if isinstance(body, bytes):
        response = client.post(path, content=body)
    else:
        response = client.post(path, json={**BASE[path], **body})
    error = expect_error(response, 400, param=param)
    assert error["message"].startswith(f"{param}: ")


def test_a_completion_prompt_longer_than_the_context_is_400(client: httpx.Client) -> None:
    length = count_tokens(client, prompt=LONG_TEXT)
    assert length > MAX_MODEL_LEN
    response = client.post(COMPLETIONS, json={"prompt": LONG_TEXT, "max_tokens": 1})
    error = expect_error(response, 400, param="prompt")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert f"your request has {length} input tokens" in error["message"]


def test_a_chat_prompt_longer_than_the_context_is_400(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": LONG_TEXT}]
    length = count_tokens(client, messages=messages)
    assert length > MAX_MODEL_LEN
    response = client.post(CHAT, json={"messages": messages, "max_tokens": 1})
    error = expect_error(response, 400, param="messages")
    assert f"your request has {length} input tokens" in error["message"]


def test_a_prompt_filling_the_whole_context_is_400(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json={"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1})
    error = expect_error(response, 400, param="prompt")
    assert f"your request has {MAX_MODEL_LEN} input tokens" in error["message"]


@pytest.mark.parametrize(
    ("path", "field"),
    [(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"), (CHAT, "max_completion_tokens")],
)
def test_max_tokens_past_the_context_is_400_naming_it(
    client: httpx.Client, path: str, field: str
) -> None:
    body = {**BASE[path], "max_tokens": None, field: MAX_MODEL_LEN}
    error = expect_error(client.post(path, json=body), 400, param=field)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_max_tokens_may_fill_the_context_exactly(client: httpx.Client) -> None:
    prompt = [1] * (MAX_MODEL_LEN - 4)
    over = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 5})
    error = expect_error(over, 400, param="max_tokens")
    assert f"you requested {MAX_MODEL_LEN + 1} tokens" in error["message"]
    exact = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    assert exact.status_code == 200, exact.text
    assert exact.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


@pytest.mark.parametrize("prompt", [[1, 2, VOCAB_SIZE], [[1, 2], [3, VOCAB_SIZE + 1000]]])
def test_a_token_id_past_the_vocabulary_is_400(client: httpx.Client, prompt: list[Any]) -> None:
    response = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
    error = expect_error(response, 400, param="prompt")
    assert str(VOCAB_SIZE) in error["message"]


def test_the_last_token_id_of_the_vocabulary_is_accepted(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json={"prompt": [VOCAB_SIZE - 1], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"logit_bias": {str(VOCAB_SIZE): 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [VOCAB_SIZE]}, "allowed_token_ids"),
        ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ],
)
def test_a_sampling_token_id_past_the_vocabulary_is_400_and_spares_the_engine(
    server: Server, client: httpx.Client, change: dict[str, Any], field: str
) -> None:
    engine = server.engine_pid()
    error = expect_error(client.post(COMPLETIONS, json={**BASE[COMPLETIONS], **change}), 400)
    assert error["message"].startswith(f"{field}: ")
    assert server.engine_pid() == engine
    assert client.get("/health").status_code == 200
    assert client.post(COMPLETIONS, json=BASE[COMPLETIONS]).status_code == 200


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_template_kwargs_clashing_with_the_renderer_are_400(
    client: httpx.Client, path: str
) -> None:
    body = {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}
    if path == CHAT:
        body["max_tokens"] = 1
    expect_error(client.post(path, json=body), 400, param="chat_template_kwargs")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_an_unknown_model_is_404(client: httpx.Client, path: str) -> None:
    body = {**BASE.get(path, {"prompt": "Hello"}), "model": "gpt-4"}
    error = expect_error(client.post(path, json=body), 404, param="model")
    assert error["code"] == "model_not_found"
    assert "'gpt-4'" in error["message"]


def test_the_served_name_is_accepted_as_model(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, json={**BASE[COMPLETIONS], "model": SERVED_NAME})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == SERVED_NAME


# Routing


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", CHAT, "OPTIONS, POST"),
        ("PUT", COMPLETIONS, "OPTIONS, POST"),
        ("DELETE", "/v1/models", "GET, OPTIONS"),
        ("DELETE", f"{ROOT_PATH}/v1/models", "GET, OPTIONS"),
        ("POST", "/health", "GET, OPTIONS"),
    ],
)
def test_a_wrong_method_is_405_with_allow(
    client: httpx.Client, method: str, path: str, allow: str
) -> None:
    response = client.request(method, path)
    error = expect_error(response, 405, param=None)
    assert error["type"] == "MethodNotAllowed"
    assert response.headers["allow"] == allow


@pytest.mark.parametrize("path", ["/v1/nope", "/nope", "/v1/models/smol", "/v1"])
def test_an_unknown_route_is_404(client: httpx.Client, path: str) -> None:
    error = expect_error(client.get(path), 404, param=None)
    assert error["message"] == f"no route for {path}"


def test_an_unknown_route_outside_v1_needs_the_key_too(anonymous: httpx.Client) -> None:
    expect_error(anonymous.get("/nope"), 401, param=None)


# Body size


def _padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes: JSON padded with whitespace."""
    body = json.dumps(BASE[COMPLETIONS]).encode()
    return body + b" " * (size - len(body))


def _chunks(body: bytes) -> Iterator[bytes]:
    for start in range(0, len(body), 64 << 10):
        yield body[start : start + (64 << 10)]


def test_a_body_over_the_limit_with_content_length_is_413(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, content=_padded(MAX_BODY + 1))
    error = expect_error(response, 413, param=None)
    assert str(MAX_BODY) in error["message"]
    # The body is left unread, so the server drops the connection: it must say so, or the
    # client reuses it for the next request and gets no answer.
    assert response.headers["connection"] == "close"
    assert client.get("/v1/models").status_code == 200


def test_a_chunked_body_over_the_limit_is_413(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, content=_chunks(_padded(MAX_BODY + 1)))
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in response.request.headers
    error = expect_error(response, 413, param=None)
    assert str(MAX_BODY) in error["message"]
    assert response.headers["connection"] == "close"
    assert client.get("/v1/models").status_code == 200


def test_a_much_larger_chunked_body_is_413(client: httpx.Client) -> None:
    response = client.post(COMPLETIONS, content=_chunks(b"x" * (8 * MAX_BODY)))
    expect_error(response, 413, param=None)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_exactly_the_limit_is_served(client: httpx.Client, chunked: bool) -> None:
    body = _padded(MAX_BODY)
    response = client.post(COMPLETIONS, content=_chunks(body) if chunked else body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


# Authentication


def test_no_key_is_401_with_a_bearer_challenge(anonymous: httpx.Client) -> None:
    response = anonymous.get("/v1/models")
    error = expect_error(response, 401, param=None)
    assert error["type"] == "AuthenticationError"
    assert response.headers["www-authenticate"] == "Bearer"


def test_no_key_on_a_generation_endpoint_is_401(anonymous: httpx.Client) -> None:
    response = anonymous.post(COMPLETIONS, json=BASE[COMPLETIONS])
    expect_error(response, 401, param=None)
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "authorization",
    [
        "Basic " + base64.b64encode(f"user:{API_KEYS[0]}".encode()).decode(),
        f"Basic {API_KEYS[0]}",
        "Bearer wrong-key",
        f"Bearer {API_KEYS[0]}x",
        "Bearer",
        API_KEYS[0],
        f"Token {API_KEYS[0]}",
    ],
)
def test_a_wrong_key_or_scheme_is_401(anonymous: httpx.Client, authorization: str) -> None:
    response = anonymous.get("/v1/models", headers={"authorization": authorization})
    expect_error(response, 401, param=None)
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {API_KEYS[1]}", f"bearer {API_KEYS[0]}", f"BEARER {API_KEYS[1]}"],
)
def test_every_key_is_accepted_under_any_scheme_case(
    anonymous: httpx.Client, authorization: str
) -> None:
    response = anonymous.get("/v1/models", headers={"authorization": authorization})
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == [SERVED_NAME]


def test_a_cors_preflight_needs_no_key(anonymous: httpx.Client) -> None:
    response = anonymous.options(CHAT)
    assert response.status_code == 204, response.text
    assert set(response.headers["allow"].split(", ")) == {"OPTIONS", "POST"}


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics"])
def test_operational_endpoints_need_no_key(anonymous: httpx.Client, path: str) -> None:
    assert anonymous.get(path).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"), [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})]
)
def test_tokenize_and_detokenize_need_the_key(
    anonymous: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    response = anonymous.post(path, json=body)
    expect_error(response, 401, param=None)
    assert response.headers["www-authenticate"] == "Bearer"
    assert anonymous.post(f"{ROOT_PATH}{path}", json=body).status_code == 401


def test_a_refusal_before_the_body_arrived_closes_the_connection(server: Server) -> None:
    # The 401 goes out while the body is still on its way: the server leaves that body unread
    # and closes the connection, so the response must say so, or a keep-alive client sends its
    # next request into a connection nobody reads ("server disconnected", seen once per suite).
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname or "", url.port or 80), timeout=30) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"content-length: 16\r\n\r\n"
        )
        received = b""
        while chunk := sock.recv(65536):  # the server closes it: no second request is read
            received += chunk
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 401"), received
    assert b"\r\nconnection: close" in head, received


def test_metrics_show_nothing_a_client_sent(client: httpx.Client) -> None:
    # Every label value is the served name or one of a fixed set: a client's model name, user,
    # request id or prompt never becomes a label (unbounded series) or a value on the page.
    canary = "canary-7f3a"
    for model in (SERVED_NAME, canary):
        client.post(
            CHAT,
            json={**BASE[CHAT], "model": model, "user": canary,
                  "messages": [{"role": "user", "content": canary}]},
            headers={"x-request-id": canary},
        )  # fmt: skip
    page = client.get("/metrics").text
    assert canary not in page
    values = {
        (name, value)
        for family in text_string_to_metric_families(page)
        if family.name.startswith("triode:")
        for sample in family.samples
        for name, value in sample.labels.items()
        if name not in ("le", "quantile")
    }
    allowed = (
        {("model_name", SERVED_NAME)}
        | {("finished_reason", r) for r in ("stop", "length", "abort", "error", "refused")}
        | {("source", s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    )
    assert values <= allowed, values - allowed


def test_the_root_path_is_guarded_too(anonymous: httpx.Client, client: httpx.Client) -> None:
    response = anonymous.get(f"{ROOT_PATH}/v1/models")
    expect_error(response, 401, param=None)
    assert response.headers["www-authenticate"] == "Bearer"
    response = client.get(f"{ROOT_PATH}/v1/models")
    assert response.status_code == 200, response.text
    assert SERVED_NAME in [m["id"] for m in response.json()["data"]]
    assert anonymous.get(f"{ROOT_PATH}/health").status_code == 200


# Without a key, a tricky spelling of a /v1 path must be refused or unrouted, never served.
TRICKY_PATHS = [
    "//v1/models",
    "/v1/../v1/models",
    "/v1/./models",
    "/v1//models",
    "/v1%2Fmodels",
    "/%76%31/models",
    "/V1/models",
    "/v1/models/",
    "/v1/models%00",
    f"{ROOT_PATH}//v1/models",
    f"{ROOT_PATH}/../v1/models",
    f"{ROOT_PATH}/v1/../v1/models",
    f"{ROOT_PATH}/v1%2Fmodels",
    f"{ROOT_PATH}%2Fv1/models",
]


@pytest.mark.parametrize("path", TRICKY_PATHS)
def test_a_tricky_path_without_a_key_never_reaches_a_handler(server: Server, path: str) -> None:
    response = raw_get(server, path)
    assert response.status_code in (401, 404), response.text
    expect_error(response, response.status_code, param=None)


@pytest.mark.parametrize(
    ("path", "routed"),
    [
        ("//v1/models", "//v1/models"),
        ("/v1/../v1/models", "/v1/../v1/models"),
        ("/v1/./models", "/v1/./models"),
        ("/V1/models", "/V1/models"),
        (f"{ROOT_PATH}/../v1/models", "/../v1/models"),
    ],
)
def test_the_router_sees_the_path_as_sent(server: Server, path: str, routed: str) -> None:
    # With a key, the 404 names the path the router (and so the key check) saw: hypercorn
    # passes dot segments and double slashes through, and nothing normalises them after.
    response = raw_get(server, path, {"authorization": f"Bearer {API_KEYS[0]}"})
    error = expect_error(response, 404, param=None)
    assert error["message"] == f"no route for {routed}"


@pytest.mark.parametrize("path", ["/v1%2Fmodels", "/%76%31/models", f"{ROOT_PATH}%2Fv1/models"])
def test_a_percent_encoded_path_is_decoded_before_the_key_check(server: Server, path: str) -> None:
    expect_error(raw_get(server, path), 401, param=None)
    response = raw_get(server, path, {"authorization": f"Bearer {API_KEYS[0]}"})
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == [SERVED_NAME]


# Small endpoints


@pytest.mark.parametrize(
    "prompt", ["The quick brown fox jumps over the lazy dog.", "naïve café — 東京 🚀\n\tend  "]
)
def test_tokenize_then_detokenize_gives_the_prompt_back(client: httpx.Client, prompt: str) -> None:
    response = client.post("/tokenize", json={"prompt": prompt})
    assert response.status_code == 200, response.text
    tokenized = response.json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert all(0 <= t < VOCAB_SIZE for t in tokenized["tokens"])
    response = client.post("/detokenize", json={"tokens": tokenized["tokens"]})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": prompt}


def test_tokenize_returns_each_tokens_text_on_request(client: httpx.Client) -> None:
    prompt = "The quick brown fox"
    response = client.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["token_strs"]) == body["count"]
    assert "".join(body["token_strs"]) == prompt


def test_tokenize_messages_applies_the_chat_template(client: httpx.Client) -> None:
    content = "The quick brown fox jumps over the lazy dog."
    bare = client.post("/tokenize", json={"prompt": content}).json()["tokens"]
    chat = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": content}]}
    ).json()["tokens"]
    assert len(chat) > len(bare)
    # the content's tokens sit inside the templated ones
    assert any(chat[i : i + len(bare)] == bare for i in range(len(chat) - len(bare) + 1))


def test_tokenize_needs_exactly_one_of_prompt_and_messages(client: httpx.Client) -> None:
    expect_error(client.post("/tokenize", json={}), 400, param="prompt")
    both = {"prompt": "Hello", "messages": MESSAGES}
    expect_error(client.post("/tokenize", json=both), 400, param="prompt")


@pytest.mark.parametrize(
    ("tokens", "param"), [([1, VOCAB_SIZE], "tokens"), ([-1], "tokens[0]"), ("1 2", "tokens")]
)
def test_detokenize_refuses_what_is_not_a_token_id(
    client: httpx.Client, tokens: Any, param: str
) -> None:
    expect_error(client.post("/detokenize", json={"tokens": tokens}), 400, param=param)


def test_version_reports_the_package_version(anonymous: httpx.Client) -> None:
    response = anonymous.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": version("triode")}


METRIC_NAMES = [
    "triode:num_requests_running",
    "triode:kv_cache_usage_perc",
    "triode:prompt_tokens_total",
    "triode:generation_tokens_total",
    "triode:time_to_first_token_seconds",
    "triode:inter_token_latency_seconds",
    "triode:e2e_request_latency_seconds",
]


def test_metrics_exposes_vllm_names_for_the_served_model(anonymous: httpx.Client) -> None:
    response = anonymous.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        # a histogram's samples are its `_bucket`s, `_count` and `_sum`
        sample = rf'^{re.escape(name)}(_bucket|_count|_sum)?{{[^}}]*model_name="{SERVED_NAME}"'
        assert re.search(sample, response.text, re.MULTILINE), name


def test_metrics_count_the_tokens_of_a_completion(client: httpx.Client) -> None:
    before = metric_values(client)
    body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 8
    after = metric_values(client)
    generated = "triode:generation_tokens_total"
    assert after[generated] == before[generated] + 8
    prompt = "triode:prompt_tokens_total"
    assert after[prompt] == before[prompt] + usage["prompt_tokens"]
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        count = f"triode:{histogram}_seconds_count"
        assert after[count] == before[count] + 1
    itl = "triode:inter_token_latency_seconds_count"
    assert after[itl] > before[itl]


# What a request may cost: every shape that costs far more than it weighs is refused, and the
# server ends healthy and idle


def _embeds(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _deep(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _tool_history(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip


HOSTILE = [
    (CHAT, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    (COMPLETIONS, {"stop": "x" * 257}, "stop"),
    (CHAT, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (COMPLETIONS, {"stop_token_ids": [1] * ((1 << 18) + 1)}, "stop_token_ids"),
    (COMPLETIONS, {"allowed_token_ids": [1] * ((1 << 18) + 1)}, "allowed_token_ids"),
    (COMPLETIONS, {"prompt": ["a"] * 65}, "prompt"),
    (COMPLETIONS, {"prompt": ["a"] * 9, "n": 8}, "n"),
    (CHAT, {"logprobs": True, "top_logprobs": 20, "n": 8, "max_tokens": 100}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 5, "n": 20, "max_tokens": 100}, "logprobs"),
    # 3.9 KB of payload that would be 4.6 MB once contiguous
    (COMPLETIONS, {"prompt_embeds": _embeds(torch.zeros(1, 576).expand(2000, 576))},
     "prompt_embeds"),
    # 230 KB decoded, five copies: past 1 MiB
    (COMPLETIONS, {"prompt_embeds": _embeds(torch.randn(100, 576)), "n": 5}, "prompt_embeds"),
    (CHAT, {"guided_json": _deep(100_000)}, "guided_json"),
    (COMPLETIONS, {"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs.json"),
    (CHAT, {"messages": _tool_history("[" * 100_000)},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": _deep(5000)},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
      "max_output_tokens": 1},
     "input[0].arguments"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "change", "param"), HOSTILE, ids=[f"{p}-{param}" for p, _, param in HOSTILE]
)
def test_a_request_that_costs_far_more_than_it_weighs_is_a_400_naming_its_field(
    client: httpx.Client, path: str, change: dict[str, Any], param: str
) -> None:
    body = {**BASE.get(path, {}), **change}
    if path == COMPLETIONS and "prompt_embeds" in change:
        body.pop("prompt")
    expect_error(client.post(path, json=body), 400, param=param)


def test_repeated_token_ids_cost_what_their_distinct_ids_do(client: httpx.Client) -> None:
    body = {**BASE[COMPLETIONS], "stop_token_ids": [7] * 200_000, "allowed_token_ids": [1, 2] * 100}
    assert client.post(COMPLETIONS, json=body).status_code == 200


async def _queue(client: httpx.AsyncClient) -> tuple[float, float]:
    """(running, waiting) requests, as /metrics has them."""
    text = (await client.get("/metrics")).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels == {"model_name": SERVED_NAME}
    }
    return values["triode:num_requests_running"], values["triode:num_requests_waiting"]


async def test_past_max_waiting_requests_a_request_is_a_429_with_retry_after(
    server: Server,
) -> None:
    headers = {"authorization": f"Bearer {API_KEYS[0]}"}
    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True}
    refused: list[httpx.Response] = []  # of the requests sent to a full queue
    all_refused = trio.Event()

    async def send(client: httpx.AsyncClient, stream: bool, full: bool = False) -> None:
        async with client.stream("POST", COMPLETIONS, json={**body, "stream": stream}) as r:
            if full:
                await r.aread()
                refused.append(r)
                if len(refused) == 4:
                    all_refused.set()
                return
            if r.status_code != 429:
                await trio.sleep_forever()  # cancelled at the end: the request is aborted

    limits = httpx.Limits(max_connections=None)
    async with (
        httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120, limits=limits) as c,
        trio.open_nursery() as nursery,
    ):
        # fill the queue: 16 running (--max-num-seqs), MAX_WAITING waiting; none of them ends
        # for a while (1000 tokens each)
        with trio.fail_after(120):  # no bound: the queue never fills
            while await _queue(c) != (16, MAX_WAITING):
                nursery.start_soon(send, c, False)
                await trio.sleep(0.2)
        for stream in (False, True, False, True):
            nursery.start_soon(send, c, stream, True)
        with trio.fail_after(60):
            await all_refused.wait()
        nursery.cancel_scope.cancel()
    for response in refused:
        # a stream too: its status waits for its first chunk, so a refusal is a plain 429
        error = expect_error(response, 429, param=None)
        assert error["type"] == "RateLimitError"
        assert int(response.headers["retry-after"]) >= 1
        assert f"{MAX_WAITING} requests are waiting" in error["message"]


def test_health_is_503_while_the_engine_core_makes_no_step_and_200_after(
    server: Server, anonymous: httpx.Client
) -> None:
    assert anonymous.get("/health").status_code == 200
    pid = server.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while (status := anonymous.get("/health").status_code) == 200:
            assert time.monotonic() < deadline, "/health stayed 200 for a stopped engine core"
            time.sleep(0.5)
        assert status == 503
        body = anonymous.get("/health")
        error = expect_error(body, 503, param=None)
        assert "engine core" in error["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while anonymous.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "/health stayed 503 after the engine core went on"
        time.sleep(0.2)


def test_after_every_hostile_request_the_server_is_healthy_and_idle(
    client: httpx.Client, anonymous: httpx.Client
) -> None:
    deadline = time.monotonic() + 60
    while True:
        values = metric_values(client)
        idle = (
            values["triode:num_requests_running"],
            values["triode:num_requests_waiting"],
            values["triode:kv_cache_usage_perc"],
        )
        if idle == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"not idle: running, waiting, KV usage {idle}"
        time.sleep(0.2)
    assert anonymous.get("/health").status_code == 200
    assert client.post(CHAT, json=BASE[CHAT]).status_code == 200
