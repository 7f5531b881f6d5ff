"""What triode's two ASGI apps, the API's `App` and `triode proxy`'s `Proxy`, route by alike.

The path a request is routed on (the scope's path less the root path: the string both the router
and the key check see), the `Allow` header and the 405 for a route's methods, and the lifespan
scope, which both only acknowledge: whatever they serve over is opened by whoever built them.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import APIError
from .http import Receive, Scope, Send


def routed_path(scope: Scope) -> str:
    """The scope's path without its root path: what both the router and the key check see."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "") or ""
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return path


def allow(methods: Iterable[str]) -> bytes:
    """The `Allow` header's value for a route serving `methods` (and OPTIONS)."""
    return ", ".join(sorted({*methods, "OPTIONS"})).encode()


def method_not_allowed(method: str, methods: Iterable[str]) -> APIError:
    return APIError(405, f"method {method} is not allowed; use {', '.join(sorted(methods))}")


async def lifespan(receive: Receive, send: Send) -> None:
    """The engine is opened by whoever built the app; lifespan only acknowledges."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
