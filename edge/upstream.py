"""The instances behind `triode proxy`: the base URL each is reached at (`base_url`), and those
of one kind, prefill or decode, taken in turn (`Instances`), with a line in the log when one
becomes unreachable and another when it is back.
"""

from __future__ import annotations

import logging

import httpx

log = logging.getLogger("triode.proxy")


def base_url(url: str) -> str:
    """`url` as the base the API paths go under: no trailing `/` or `/v1`.

    Raises `ValueError` for anything but an http(s) URL with a host.
    """
    base = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    try:
        parsed = httpx.URL(base)
    except httpx.InvalidURL as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http(s) URL with a host, like http://127.0.0.1:8100")
    return base


class Instances:
    """The instances of one kind, taken in turn."""

    def __init__(self, kind: str, urls: list[str]) -> None:
        self.kind = kind
        self.urls = urls
        self._next = 0
        self._unreachable: set[str] = set()

    def in_turn(self) -> list[str]:
        """Every instance, the one whose turn it is first; each call moves the turn on by one."""
        start = self._next
        self._next = (start + 1) % len(self.urls)
        return self.urls[start:] + self.urls[:start]

    def refused(self, url: str, error: httpx.HTTPError) -> None:
        if url not in self._unreachable:
            self._unreachable.add(url)
            log.warning("%s instance %s is unreachable: %s", self.kind, url, describe(error))

    def reached(self, url: str) -> None:
        if url in self._unreachable:
            self._unreachable.discard(url)
            log.info("%s instance %s is reachable again", self.kind, url)


def describe(error: httpx.HTTPError) -> str:
    """The error as the log and the 502s say it: its message, else its type's name."""
    return str(error) or type(error).__name__
