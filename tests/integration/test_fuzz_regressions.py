"""Faults the live fuzzer (`triode fuzz`) found in a real `triode serve`, each pinned by the bytes
that exposed it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server import Server, running_server

pytestmark = pytest.mark.slow

KEY = "regression-key"

# Refused for its key, framed both as chunked and by length (so its body is no valid chunk).
REFUSED_WITH_BROKEN_FRAMING = (
    b"POST /v1/completions HTTP/1.1\r\n"
    b"host: 127.0.0.1\r\n"
    b"authorization:\r\n"
    b"content-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n"
    b"content-length: 36\r\n"
    b"connection: close\r\n"
    b"\r\n"
    b'{"prompt": "Hello", "max_tokens": 1}'
)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log: Path = tmp_path_factory.mktemp("fuzz-regressions") / "serve.log"
    with running_server(["tiny-random", "--api-key", KEY], log) as server:
        yield server


def _send_and_half_close(url: str, data: bytes) -> None:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(65536):
                pass


def test_a_client_half_closing_while_refused_does_not_stop_the_server(
    tiny_server: Server,
) -> None:
    # hypercorn's close raced its error response on the same stream; the losing send's
    # BusyResourceError escaped the connection and stopped the whole server within a few tries.
    for _ in range(40):
        _send_and_half_close(tiny_server.url, REFUSED_WITH_BROKEN_FRAMING)
    assert tiny_server.process.poll() is None, tiny_server.output()
    assert "Error in ASGI Framework" not in tiny_server.output()
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
    response = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
