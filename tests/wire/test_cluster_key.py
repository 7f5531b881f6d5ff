"""The cluster key: its file, the CurveZMQ sockets it guards, and the store values it seals."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from triode.wire import ProtocolError
from triode.wire.cluster_key import (
    MAX_FILE_BYTES,
    MAX_SEALED_BYTES,
    ClusterGate,
    ClusterKey,
    ClusterKeyError,
    apply_options,
)

WAIT_MS = 300  # how long a refused client's message is given to (not) arrive


def _key_file(tmp_path: Path, text: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "cluster.key"
    path.write_bytes(text)
    path.chmod(mode)
    return path


def test_a_written_key_file_is_private_and_loads_back(tmp_path: Path) -> None:
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    key.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert ClusterKey.load(path) == key
    assert key.secret.decode() not in repr(key)
    with pytest.raises(FileExistsError):
        ClusterKey.generate().write(path)  # never over an existing key
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        key.write(link)  # nor through a symlink
    assert not (tmp_path / "elsewhere").exists()


def test_the_python_one_liner_makes_a_key_file(tmp_path: Path) -> None:
    secret = zmq.curve_keypair()[1]  # what the README's one-liner prints
    key = ClusterKey.load(_key_file(tmp_path, secret + b"\n"))
    assert key.public == zmq.curve_public(secret)


@pytest.mark.parametrize(
    ("text", "mode", "says"),
    [
        (None, 0o600, "No such file"),
        (b"x" * 40, 0o644, "accessible by group or others (mode 0644); chmod 600"),
        (b"x" * 40, 0o620, "accessible by group or others"),
        (b"", 0o600, "not a cluster key"),
        (b"too short", 0o600, "not a cluster key"),
        (b"\x00" * 40, 0o600, "not a cluster key"),
        (b" " * (MAX_FILE_BYTES + 1), 0o600, f"is over {MAX_FILE_BYTES} bytes"),
    ],
)
def test_a_bad_key_file_is_one_clear_error(
    tmp_path: Path, text: bytes | None, mode: int, says: str
) -> None:
    path = tmp_path / "missing.key" if text is None else _key_file(tmp_path, text, mode)
    with pytest.raises(ClusterKeyError, match=re.escape(says)) as caught:
        ClusterKey.load(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_directory_is_not_a_key_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    with pytest.raises(ClusterKeyError, match="not a regular file"):
        ClusterKey.load(tmp_path / "d")


def test_several_nodes_need_a_key_and_one_node_none(tmp_path: Path) -> None:
    assert ClusterKey.for_world(False, None) is None
    with pytest.raises(ClusterKeyError, match="triode cluster-key PATH"):
        ClusterKey.for_world(True, None)
    key = ClusterKey.generate()
    key.write(tmp_path / "k")
    assert ClusterKey.for_world(True, str(tmp_path / "k")) == key


def test_a_sealed_store_value_opens_only_unchanged_under_its_name_and_key() -> None:
    key, other = ClusterKey.generate(), ClusterKey.generate()
    sealed = key.seal("triode/cluster", b'{"result": "tcp://10.0.0.1:5555"}')
    assert key.open("triode/cluster", sealed) == b'{"result": "tcp://10.0.0.1:5555"}'
    forged = sealed[:-3] + b'6"}'
    for name, value, by in [
        ("triode/cluster", forged, key),
        ("triode/other", sealed, key),
        ("triode/cluster", sealed, other),
        ("triode/cluster", b"", key),
        ("triode/cluster", b'{"result": "tcp://evil:1"}', key),
        ("triode/cluster", b"x" * (MAX_SEALED_BYTES + 1), key),  # refused before hashing
    ]:
        with pytest.raises(ProtocolError):
            by.open(name, value)


Served = tuple[zmq.Context, ClusterKey, ClusterGate, zmq.Socket, str]


@pytest.fixture
def gate_and_server() -> Iterator[Served]:
    ctx = zmq.Context()
    key = ClusterKey.generate()
    gate = ClusterGate(ctx, key)
    server = ctx.socket(zmq.PULL)
    server.setsockopt(zmq.LINGER, 0)
    apply_options(server, key.server_options())
    server.bind("tcp://127.0.0.1:*")
    yield ctx, key, gate, server, server.getsockopt_string(zmq.LAST_ENDPOINT)
    gate.close()
    gate.close()
    ctx.destroy(linger=0)  # the clients too, should the test have failed before closing them


def _push(ctx: zmq.Context, endpoint: str, options: list[tuple[int, Any]]) -> zmq.Socket:
    """A client that sends once its connection is up (a PUSH has no peer before that).

    A refused client's pipe can be writable for a moment and gone by the send (the handshake
    failed in between): that send finds no peer, which is the refusal the test is after; the
    server's side then asserts that nothing arrived.
    """
    client = ctx.socket(zmq.PUSH)
    client.setsockopt(zmq.LINGER, 0)
    apply_options(client, options)
    client.connect(endpoint)
    if client.poll(WAIT_MS, zmq.POLLOUT):
        with contextlib.suppress(zmq.Again):
            client.send(b"hello", zmq.NOBLOCK)
    return client


def test_only_a_client_with_the_cluster_key_pair_gets_through(gate_and_server: Served) -> None:
    ctx, key, gate, server, endpoint = gate_and_server
    stranger = ClusterKey.generate()
    clients = [
        _push(ctx, endpoint, []),  # no Curve at all: libzmq drops the handshake
        # knows the server's public key, proves another key pair: the gate refuses it
        _push(ctx, endpoint, [*stranger.client_options()[1:], (zmq.CURVE_SERVERKEY, key.public)]),
        _push(ctx, endpoint, stranger.client_options()),  # another cluster's key altogether
    ]
    assert not server.poll(WAIT_MS)
    assert gate.refused >= 1 and gate.admitted == 0
    member = _push(ctx, endpoint, key.client_options())
    assert server.poll(10_000)
    assert server.recv() == b"hello"
    assert gate.admitted == 1
    assert not server.poll(WAIT_MS)  # and nothing from the others meanwhile
    for client in [*clients, member]:
        client.close()


def test_the_gate_closes_before_its_context_terms() -> None:
    ctx = zmq.Context()
    gate = ClusterGate(ctx, ClusterKey.generate())
    gate.close()
    ctx.term()  # would block on the handler's socket were it still open
    assert ctx.closed
