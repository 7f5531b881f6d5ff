"""The API server processes' supervisor: a dead one is replaced, one that keeps dying stops the
whole server, and the settings reach each process intact (real child processes)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import msgspec
import pytest
import trio

from triode.edge import api_servers
from triode.edge.api_servers import (
    ApiServerOptions,
    _ApiServers,
    bind_shared,
    settings_from_builtins,
    settings_to_builtins,
)
from triode.edge.auth import ApiKeys
from triode.edge.settings import Settings

CHILD_TARGETS = Path(__file__).parents[1] / "actors"


def _options(index: int) -> ApiServerOptions:
    return ApiServerOptions(
        client_index=index, host="127.0.0.1", port=0, endpoints=[], settings={},
        api_key_digests=[],
    )  # fmt: skip


@pytest.mark.slow
async def test_an_api_server_that_keeps_dying_stops_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = [str(CHILD_TARGETS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    servers = _ApiServers(1, _options, str(tmp_path), target="child_targets:crash_after_ready")
    pids = set()

    async def note_pids() -> None:
        while True:
            pids.add(servers.pids[0])
            await trio.sleep(0.01)

    with trio.fail_after(60):
        with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="died 5 times")):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(note_pids)
                await servers.supervise(0)
    # restarted after each of the first four deaths, each a new process
    assert servers.restarts == api_servers.MAX_RESTARTS - 1
    assert len(pids - {None}) == api_servers.MAX_RESTARTS
    assert servers.all_ready.is_set()


def test_settings_and_hashed_keys_reach_an_api_server_as_they_were() -> None:
    settings = Settings(
        served_model_names=["smol", "alias"], api_keys=ApiKeys(["k1", "k2"]), max_body_size=1234,
        tool_servers=["localhost:9000"], max_tool_turns=3,
    )  # fmt: skip
    fields, digests = settings_to_builtins(settings)
    sent = msgspec.msgpack.encode([fields, digests])  # as the parent sends them
    again = settings_from_builtins(*msgspec.msgpack.decode(sent))

    assert dataclasses.replace(again, api_keys=None) == dataclasses.replace(settings, api_keys=None)
    assert again.api_keys.digests == settings.api_keys.digests
    assert all(b"k1" not in d and b"k2" not in d for d in digests)  # only the digests travel
    assert again.api_keys.check(b"Bearer k2") and not again.api_keys.check(b"Bearer k3")


def test_the_parent_and_each_api_server_bind_the_same_port() -> None:
    parent = bind_shared("127.0.0.1", 0)
    port = parent.getsockname()[1]
    children = [bind_shared("127.0.0.1", port) for _ in range(2)]
    try:
        for child in children:
            child.listen()
        assert {c.getsockname()[1] for c in children} == {port}
    finally:
        for sock in (parent, *children):
            sock.close()
