"""Raw ASGI plumbing: one request's scope and body in, whole responses out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import trio

from .errors import APIError, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"

_encoder = msgspec.json.Encoder()


class Request:
    """What a handler sees of an HTTP request: method, the routed path, headers, body."""

    __slots__ = (
        "body", "body_read", "disconnected", "headers", "key_digest", "method", "path", "query",
        "receive", "response_headers", "scope", "send", "started",
    )  # fmt: skip

    def __init__(self, scope: Scope, path: str, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.method: str = scope["method"]
        self.path = path
        self.query: bytes = scope.get("query_string", b"")
        self.headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            # a repeated header keeps its first value; nothing here needs the others
            self.headers.setdefault(name.lower(), value)
        self.receive = receive
        self.send = send
        self.body = b""
        self.body_read = False
        self.started = False  # a response has begun: errors can no longer change its status
        self.disconnected = False  # seen by `cancel_on_disconnect`
        # SHA-256 of the API key the request was authenticated with; None without one
        self.key_digest: bytes | None = None
        # headers that whatever response this request gets carries (added by the app's `send`)
        self.response_headers: Headers = []

    async def read_body(self, limit: int) -> bytes:
        """The whole body; a 413 `APIError` as soon as it is known to exceed `limit` bytes."""
        declared = self.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and _exceeds(declared, limit):
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)
        self.body_read = True
        return self.body

    @property
    def body_left_unread(self) -> bool:
        """The client sends (or sent) a body that no handler read: hypercorn closes such a
        connection once the response is out, so the response must say so, or the client would
        send its next request into a connection nobody reads."""
        if self.body_read:
            return False
        length = self.headers.get(b"content-length")
        return b"transfer-encoding" in self.headers or (length is not None and length != b"0")

    async def cancel_on_disconnect(self, scope: trio.CancelScope) -> None:
        """Once the body is read: wait for the client to disconnect, then note it
        (`disconnected`) and cancel `scope`."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        scope.cancel()


class ClientDisconnected(Exception):
    """The client went away before its request was read."""


def _exceeds(digits: bytes, limit: int) -> bool:
    # Compare lengths first: int() refuses numbers of more than 4,300 digits.
    digits = digits.lstrip(b"0")
    return len(digits) > len(str(limit)) or int(digits or b"0") > limit


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes")


async def respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = JSON,
    headers: Headers | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, value: Any, status: int = 200, **kwargs: Any) -> None:
    await respond(send, status, _encoder.encode(value), **kwargs)


async def respond_error(send: Send, error: APIError, headers: Headers | None = None) -> None:
    await respond(send, error.status, error_body(error), headers=headers)


def encode_json(value: Any) -> bytes:
    return _encoder.encode(value)
