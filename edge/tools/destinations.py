"""Where a tool server that a request names may be: at public addresses, checked where each
connection is made.

A request-supplied MCP `server_url` (`--allow-request-tool-servers`) makes this server open HTTP
connections wherever a client says: to services on its own loopback, the private network behind
it, or a cloud metadata endpoint (169.254.169.254, fd00:ec2::254) that hands out credentials.
So every address such a URL's host resolves to must be public (not loopback, private,
link-local, multicast, unspecified, reserved or shared address space, nor such an IPv4 address
inside an IPv6 one), unless the operator allows private ones (`--allow-private-tool-servers`).

The check runs twice. `check_destination` runs before the first connection, so that a refused
URL is a 400 naming it. The transport of `checked_client` runs it at every connection (a
redirect's included) and connects only to an address it has just resolved and checked, so a
name that resolves to a public address for the first check and to a private one a moment later
(DNS rebinding) still reaches only a public one; TLS still verifies the URL's host name. The
client takes no proxy from the environment (a proxy would connect elsewhere than the checked
address) and reads at most `MAX_RESPONSE_BYTES` of any one response.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterable
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Final
from urllib.parse import urlsplit

import anyio
import httpcore2
import httpx2

Address = IPv4Address | IPv6Address

# the cloud instance metadata services' addresses (AWS, its IPv6 one, Alibaba)
METADATA: Final = frozenset(
    ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
# what one HTTP response from a request-named server may hold (a listing, a tool's result)
MAX_RESPONSE_BYTES: Final = 16 << 20

_NAT64 = ip_network("64:ff9b::/96")
_LIMITS = httpx2.Limits(max_connections=16, max_keepalive_connections=4, keepalive_expiry=5.0)


class DestinationRefused(httpcore2.ConnectError):
    """A tool server's host resolves to an address it may not be at (or does not resolve).

    A `ConnectError`, so that an HTTP client reports it as a connection that failed; its
    message is written here and names only the host and the address."""


def refusal(address: Address) -> str | None:
    """Why a tool server may not be at `address`, or None for a public address."""
    if address in METADATA:
        return "a cloud metadata address"
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return refusal(embedded)
    for reason, refused in (
        ("a loopback address", address.is_loopback),
        ("a link-local address", address.is_link_local),
        ("a multicast address", address.is_multicast),
        ("the unspecified address", address.is_unspecified),
        ("a private address", address.is_private),
    ):
        if refused:
            return reason
    return None if address.is_global else "not a public address"


async def check_destination(url: str, *, allow_private: bool = False) -> None:
    """Raise `DestinationRefused` unless every address `url`'s host resolves to is allowed. A
    checkpoint (name resolution); cancelled, nothing is checked."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    await _checked_addresses(parts.hostname or "", port, allow_private=allow_private)


def checked_client(
    *,
    allow_private: bool = False,
    timeout: httpx2.Timeout | None = None,
    headers: dict[str, str] | None = None,
    auth: httpx2.Auth | None = None,
) -> httpx2.AsyncClient:
    """An HTTP client whose every connection goes to a checked address (see the module), with
    no proxy from the environment and responses of at most `MAX_RESPONSE_BYTES`. The MCP
    transports' client factory takes the same arguments."""
    transport = httpx2.AsyncHTTPTransport(trust_env=False, limits=_LIMITS)
    # httpx builds its connection pool in __init__ and takes no network backend: this pool is
    # the one it builds, with the backend that checks
    transport._pool = httpcore2.AsyncConnectionPool(
        ssl_context=httpx2.create_ssl_context(trust_env=False),
        max_connections=_LIMITS.max_connections,
        max_keepalive_connections=_LIMITS.max_keepalive_connections,
        keepalive_expiry=_LIMITS.keepalive_expiry,
        network_backend=_CheckedBackend(allow_private=allow_private),
    )
    return httpx2.AsyncClient(
        transport=_CappedTransport(transport),
        timeout=timeout,
        headers=headers,
        auth=auth,
        trust_env=False,
    )


async def _checked_addresses(host: str, port: int, *, allow_private: bool) -> list[Address]:
    """The addresses `host` resolves to, if each is allowed; else `DestinationRefused`."""
    try:
        addresses = await _resolve(host, port)
    except (OSError, UnicodeError):
        raise DestinationRefused(f"the host {host!r} does not resolve") from None
    if not addresses:
        raise DestinationRefused(f"the host {host!r} does not resolve")
    if not allow_private:
        for address in addresses:
            reason = refusal(address)
            if reason is not None:
                raise DestinationRefused(
                    f"the host {host!r} resolves to {address}, {reason}; this server does "
                    "not allow tool servers there"
                )
    return addresses


async def _resolve(host: str, port: int) -> list[Address]:
    """The addresses `host` has now (the system's resolver: /etc/hosts, DNS)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # a link-local IPv6 address comes with its zone (fe80::1%eth0)
    return list(dict.fromkeys(ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _embedded_ipv4(address: Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where it goes."""
    if isinstance(address, IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return IPv4Address(int(address) & 0xFFFFFFFF)
    return None


class _CheckedBackend(httpcore2.AsyncNetworkBackend):
    """Connects to the addresses a host resolves to now, once each is checked."""

    def __init__(self, *, allow_private: bool) -> None:
        self._inner = httpcore2.AnyIOBackend()
        self._allow_private = allow_private

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        addresses = await _checked_addresses(host, port, allow_private=self._allow_private)
        failure: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    str(address), port, timeout, local_address, socket_options
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as e:
                failure = e
        assert failure is not None
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        raise DestinationRefused("a tool server is not reached through a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _CappedTransport(httpx2.AsyncBaseTransport):
    """A transport whose responses end in an error past `MAX_RESPONSE_BYTES`."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        response.stream = _CappedStream(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        with contextlib.suppress(httpx2.TransportError):
            async for chunk in self._inner:
                seen += len(chunk)
                if seen > MAX_RESPONSE_BYTES:
                    # closing the connection ends the iteration where it is; leaving the loop
                    # instead would leave httpx's stream generators to the garbage collector
                    await self._inner.aclose()
                    continue
                yield chunk
        if seen > MAX_RESPONSE_BYTES:
            raise httpx2.ReadError(
                f"the tool server sent more than {MAX_RESPONSE_BYTES} bytes in one answer"
            )

    async def aclose(self) -> None:
        await self._inner.aclose()
