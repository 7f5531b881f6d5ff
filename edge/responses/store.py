"""The stored responses of one server process: in memory, the most recent `capacity` of them.

A stored response is what `GET /v1/responses/{id}` returns and what `previous_response_id`
continues from (the conversation up to and including its output). A background response also
keeps the cancel scope its run lives in, so `cancel` can stop it, and an event that is set when
the run has ended.

Each response belongs to the key that created it (`owner`, the SHA-256 digest of the caller's
key; empty when the server has no keys, and all callers are one tenant): another key's lookup
finds nothing, as OpenAI answers a response of another project with a 404. A finished response
is dropped `ttl` seconds after its run ended; the least recently used finished ones go first when
the store is over `capacity`. A running background response is never dropped: it would run on
with nobody able to cancel it, and dropping by cancelling would let any client's burst of new
responses cancel another's work. Their number is bounded by the caller
(`--max-background-responses`), so the store holds at most `capacity` plus that many.

The finished responses' bytes (each its response and conversation as JSON, counted when its run
ends) are bounded too, by `max_bytes` (`--max-stored-response-bytes`): past it the least
recently used finished ones go, the one just finished last (a response larger than the whole
budget is answered, then not kept). A count alone let 1,000 responses of 4 MiB each hold 4 GiB.
"""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from .response import TERMINAL, Response

# what the finished responses of one server process may hold at most, by default
DEFAULT_MAX_BYTES = 256 << 20
_JSON = msgspec.json.Encoder()


@dataclass
class StoredResponse:
    response: Response
    # the chat messages the next turn continues from (without instructions); None until done
    conversation: list[dict[str, Any]] | None = None
    scope: trio.CancelScope | None = None  # a background run's
    done: trio.Event = field(default_factory=trio.Event)
    owner: bytes = b""  # the SHA-256 digest of the creating key; b"" on a server without keys
    ended_at: float = math.inf  # the store's clock when the run ended
    nbytes: int = 0  # its response and conversation as JSON, counted when its run ended

    @property
    def running(self) -> bool:
        return self.response.status not in TERMINAL

    @property
    def running_in_background(self) -> bool:
        return self.scope is not None and not self.done.is_set()


class ResponseStore:
    """Responses by id, least recently used evicted first (running background ones never)."""

    def __init__(
        self,
        capacity: int = 1000,
        *,
        ttl: float = math.inf,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity: must be at least 1")
        if not ttl > 0:
            raise ValueError("ttl: must be positive")
        if max_bytes < 1:
            raise ValueError("max_bytes: must be at least 1")
        self.capacity = capacity
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.nbytes = 0  # the finished responses' (`StoredResponse.nbytes`)
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: StoredResponse) -> None:
        self._expire()
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        excess = len(self._entries) - self.capacity
        if excess <= 0:
            return
        # finished ones first, then foreground runs (their clients hold them and can stop them
        # by leaving), never a running background one
        new = entry.response.id
        finished = [
            k for k, e in self._entries.items()
            if not e.running and not e.running_in_background and k != new
        ]  # fmt: skip
        foreground = [
            k for k, e in self._entries.items() if e.running and e.scope is None and k != new
        ]
        for victim in [*finished, *foreground][:excess]:
            self._drop(victim)

    def ended(self, entry: StoredResponse) -> None:
        """Note that `entry`'s run has ended: its time to live starts now, and its bytes count
        against `max_bytes` (the least recently used finished responses go past it)."""
        entry.ended_at = self._clock()
        if entry.response.id not in self._entries or entry.nbytes:
            return
        entry.nbytes = len(_JSON.encode(entry.response)) + len(_JSON.encode(entry.conversation))
        self.nbytes += entry.nbytes
        if entry.nbytes > self.max_bytes:  # answered; kept, it would push out every other
            self._drop(entry.response.id)
            return
        self._entries.move_to_end(entry.response.id)
        for key in [k for k, e in self._entries.items() if e.nbytes]:
            if self.nbytes <= self.max_bytes:
                break
            self._drop(key)

    def get(self, response_id: str, owner: bytes = b"") -> StoredResponse | None:
        """The response `response_id` if `owner` created it and it has not expired."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._expired(entry):
            self._drop(response_id)
            return None
        if not secrets.compare_digest(entry.owner, owner):
            return None
        self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def _drop(self, response_id: str) -> None:
        self.nbytes -= self._entries.pop(response_id).nbytes

    def _expired(self, entry: StoredResponse) -> bool:
        if entry.ended_at == math.inf or entry.running_in_background:
            return False
        return self._clock() - entry.ended_at >= self.ttl

    def _expire(self) -> None:
        for key in [k for k, e in self._entries.items() if self._expired(e)]:
            self._drop(key)
