"""hypercorn's connection as `serve_asgi` runs it: what a response writes reaches a client whole
and in order, however fast the client reads, and a client that stops reading holds up no one
else."""

from __future__ import annotations

from typing import Any

import h11
import pytest
import trio

from triode.edge import asgi_server

CHUNK = 64 * 1024
CHUNKS = 48  # 3 MiB: far past what the sockets' buffers hold for a client that is not reading


def _chunk(i: int) -> bytes:
    return (b"%06d" % i) * (CHUNK // 6)


async def _streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    count = CHUNKS if scope["path"] == "/big" else 1
    for i in range(count):
        await send({"type": "http.response.body", "body": _chunk(i), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _get(port: int, path: str, *, stall: float = 0.0) -> bytes:
    """GET `path`, reading nothing for `stall` seconds first; the response's body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=path, headers=[("host", "test")])
    await stream.send_all(client.send(request) + client.send(h11.EndOfMessage()))
    await trio.sleep(stall)
    body = bytearray()
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(CHUNK))
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            await stream.aclose()
            return bytes(body)


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(bytes offered, bytes taken) of every write the connection tried at once."""
    seen: list[tuple[int, int]] = []
    send_now = asgi_server._send_now

    def counted(fd: int, data: bytes) -> int:
        sent = send_now(fd, data)
        seen.append((len(data), sent))
        return sent

    monkeypatch.setattr(asgi_server, "_send_now", counted)
    return seen


async def test_a_stalled_reader_gets_every_byte_in_order_and_holds_up_no_one(
    sends: list[tuple[int, int]],
) -> None:
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: asgi_server.serve_asgi(
                _streaming_app,
                host="127.0.0.1",
                port=0,
                graceful_timeout=1,
                task_status=task_status,
            )
        )
        port = int(urls[0].rsplit(":", 1)[1])
        big: list[bytes] = []
        done = trio.Event()

        async def stalled() -> None:
            big.append(await _get(port, "/big", stall=1.0))
            done.set()

        nursery.start_soon(stalled)
        await trio.sleep(0.3)  # the big response has filled the buffers and waits
        with trio.fail_after(5):
            assert await _get(port, "/small") == _chunk(0)  # while the other one stalls
        assert not big
        with trio.fail_after(30):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert big[0] == b"".join(_chunk(i) for i in range(CHUNKS))
    # most writes went out at once; those the socket took part of (or none) went on the usual
    # way, their rest after what was taken
    assert sum(1 for offered, taken in sends if taken == offered) > CHUNKS // 2
    assert any(taken < offered for offered, taken in sends)
