"""Inputs the fuzz harnesses found: each gets a 4xx or the right answer, never a crash."""

from __future__ import annotations

import time
from typing import Any

import pytest

from triode.edge.auth import ApiKeys
from triode.edge.completions.request_bodies import ChatCompletionRequest, decode_request
from triode.edge.completions.sampling import sampling_params
from triode.edge.errors import APIError
from triode.edge.http import Request
from triode.edge.sse import SSEParser
from triode.wire import (
    Encoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    encode_input,
)

CHAT = b'{"messages": [{"role": "user", "content": "Hi"}]'


def test_deeply_nested_json_is_a_400_not_a_recursion_error() -> None:
    body = CHAT + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    with pytest.raises(APIError) as caught:
        decode_request(body, ChatCompletionRequest)

    assert caught.value.status == 400
    assert "nested too deeply" in caught.value.message


@pytest.mark.parametrize("top_k", [2**31, 2**64, 10**30])
def test_a_top_k_past_any_vocabulary_is_off_and_crosses_the_wire(top_k: int) -> None:
    req = decode_request(CHAT + b', "top_k": %d}' % top_k, ChatCompletionRequest)
    params = sampling_params(req, prompt_len=4, max_model_len=64)

    assert params.top_k == 0
    frames = encode_input(
        Encoder(), EngineCoreRequestType.ADD_REQUEST, EngineCoreRequest("r", [1], params)
    )
    _, decoded = InputDecoder().decode([bytes(f) for f in frames])
    assert isinstance(decoded, EngineCoreRequest) and decoded.sampling_params.top_k == 0


def test_a_top_k_below_the_vocabulary_is_kept() -> None:
    req = decode_request(CHAT + b', "top_k": 40}', ChatCompletionRequest)

    assert sampling_params(req, prompt_len=4, max_model_len=64).top_k == 40


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer k\x1c",
        b"Bearer \x1fk",
        b"\x0bBearer k",
        b"Bearer k\x0c",
        b"Bearer k\r\n",
        b"Bearer \x1ek\x1d",
    ],
)
def test_control_characters_around_the_key_are_refused(header: bytes) -> None:
    # str.strip() takes them for whitespace; the token would then match the key.
    assert not ApiKeys(["k"]).check(header)


def test_spaces_and_tabs_around_the_key_still_pass() -> None:
    assert ApiKeys(["k"]).check(b" \tBearer \t k \t")


def _request(headers: list[tuple[bytes, bytes]], body: bytes) -> Request:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        raise AssertionError("no response expected")

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    return Request(scope, "/v1/completions", receive, send)


@pytest.mark.parametrize("digits", [4301, 10_000])
async def test_a_content_length_of_thousands_of_digits_is_a_413(digits: int) -> None:
    request = _request([(b"content-length", b"9" * digits)], b"{}")

    with pytest.raises(APIError) as caught:
        await request.read_body(1 << 20)

    assert caught.value.status == 413


async def test_a_content_length_with_leading_zeros_is_read_as_its_value() -> None:
    request = _request([(b"content-length", b"0" * 5000 + b"2")], b"{}")

    assert await request.read_body(1 << 20) == b"{}"


def test_a_long_line_in_small_chunks_parses_in_linear_time() -> None:
    line = b"data: " + b"x" * (1 << 20) + b"\n\n"
    parser = SSEParser()
    events = []

    start = time.perf_counter()
    for i in range(0, len(line), 64):
        events += parser.feed(line[i : i + 64])

    # Rejoining the partial line on every chunk took seconds here (quadratic); now milliseconds.
    assert time.perf_counter() - start < 1.0
    assert events == [b"x" * (1 << 20)]
