"""The stored responses' bytes, all together, are bounded: past `max_bytes` the least recently
used finished ones go, the one just finished last; a running one never counts nor goes; a
stored field as large as a request may carry is refused where the request is decoded."""

from __future__ import annotations

import msgspec
import pytest
import trio

from triode.edge.responses.request import MAX_USER, ResponsesRequest
from triode.edge.responses.response import Response
from triode.edge.responses.store import ResponseStore, StoredResponse

KIB = 1024


def _finished(store: ResponseStore, rid: str, text_bytes: int) -> StoredResponse:
    entry = StoredResponse(Response(id=rid, model="m", status="completed"))
    entry.conversation = [{"role": "assistant", "content": "x" * text_bytes}]
    store.add(entry)
    store.ended(entry)
    return entry


def test_finished_responses_past_the_byte_budget_go_least_recently_used_first() -> None:
    store = ResponseStore(capacity=1000, max_bytes=100 * KIB, clock=lambda: 0.0)
    entries = [_finished(store, f"r{i}", 30 * KIB) for i in range(3)]
    assert store.nbytes == sum(e.nbytes for e in entries) <= 100 * KIB
    assert store.get("r0") is entries[0]  # used: r1 is now the least recently used
    _finished(store, "r3", 30 * KIB)
    assert store.get("r1") is None
    assert [store.get(r) is not None for r in ("r0", "r2", "r3")] == [True, True, True]
    assert store.nbytes <= 100 * KIB
    store.pop("r0")
    assert store.nbytes == sum(store.get(r).nbytes for r in ("r2", "r3"))  # type: ignore[union-attr]


def test_a_response_larger_than_the_whole_budget_is_not_kept_and_takes_nothing_with_it() -> None:
    store = ResponseStore(max_bytes=100 * KIB, clock=lambda: 0.0)
    kept = _finished(store, "small", KIB)
    _finished(store, "huge", 200 * KIB)
    assert store.get("huge") is None and store.get("small") is kept
    assert store.nbytes == kept.nbytes


def test_a_running_background_response_neither_counts_nor_goes() -> None:
    store = ResponseStore(max_bytes=10 * KIB, clock=lambda: 0.0)
    running = StoredResponse(
        Response(id="bg", model="m", status="in_progress"), scope=trio.CancelScope()
    )
    store.add(running)
    _finished(store, "big", 20 * KIB)
    assert store.get("bg") is running and store.nbytes == 0


def test_the_user_field_is_capped_where_the_request_is_decoded() -> None:
    body = {"model": "m", "input": "hi", "user": "u" * (MAX_USER + 1)}
    with pytest.raises(msgspec.ValidationError, match="user"):
        msgspec.json.decode(msgspec.json.encode(body), type=ResponsesRequest)
    body["user"] = "u" * MAX_USER
    assert msgspec.json.decode(msgspec.json.encode(body), type=ResponsesRequest).user
