"""The stored responses of one server process: in memory, the most recent `capacity` of them.

A stored response is what `GET /v1/responses/{id}` returns and what `previous_response_id`
continues from (the conversation up to and including its output). A background response also
keeps the cancel scope its run lives in, so `cancel` can stop it, and an event that is set when
the run has ended.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

from .responses_protocol import TERMINAL, Response


@dataclass
class StoredResponse:
    response: Response
    # the chat messages the next turn continues from (without instructions); None until done
    conversation: list[dict[str, Any]] | None = None
    scope: trio.CancelScope | None = None  # a background run's
    done: trio.Event = field(default_factory=trio.Event)

    @property
    def running(self) -> bool:
        return self.response.status not in TERMINAL


class ResponseStore:
    """Responses by id, least recently used evicted first (those still running last)."""

    def __init__(self, capacity: int = 1000) -> None:
        if capacity < 1:
            raise ValueError("capacity: must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            victim = next((k for k, e in self._entries.items() if not e.running), None)
            self._entries.pop(victim if victim is not None else next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._entries.pop(response_id, None)
