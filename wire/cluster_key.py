"""The secret that the nodes of one multi-node world share, and what it guards.

The file (`--cluster-key-file`, made by `triode cluster-key PATH`) holds one line: a CurveZMQ
secret key in Z85 (40 characters); the public key is derived from it. Every node holds the same
file, so every ZMQ socket between nodes is CurveZMQ with that one key pair on both ends: a
client must know the server's public key to complete the handshake, and the server's ZAP
handler (`ClusterGate`) admits only clients that prove the cluster's secret key. The values
that tell ranks where to connect, published through torch.distributed's store (which any host
that reaches it may write), are sealed with an HMAC under a key derived from the same secret,
and a rank opens them before it connects anywhere.

The file must be a regular file that only its owner may read or write (0600, as ssh asks of
its keys): anyone who can read it can join the world.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from .errors import ProtocolError
from .private_file import read_private_file

KEY_CHARS = 40  # a 32-byte Curve key in Z85
MAX_FILE_BYTES = 4096  # what load reads at most: one key line, with room for whitespace
# a sealed store value (the executor's addresses: ~300 bytes); anyone may write the store, so a
# value past this is refused before its MAC is computed
MAX_SEALED_BYTES = 64 << 10
_MAC = hashlib.sha256
_MAC_BYTES = _MAC().digest_size
_STORE_CONTEXT = b"triode cluster store values v1"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq looks for a context's ZAP handler
_Z85_CHARS = set(z85.Z85CHARS)
MAKE_ONE = "make one with `triode cluster-key PATH` and give every node the same file"


class ClusterKeyError(ValueError):
    """A cluster key file that is missing, readable by others, or does not hold a key."""


@dataclass(frozen=True, repr=False)
class ClusterKey:
    """One world's Curve key pair (Z85) and the store-sealing key derived from it."""

    secret: bytes
    public: bytes
    _mac_key: bytes = field(compare=False)

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"ClusterKey(public={self.public.decode()})"

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKey:
        secret = secret.strip()
        if len(secret) != KEY_CHARS or not set(secret) <= _Z85_CHARS:
            raise ClusterKeyError(f"not a cluster key (one line of {KEY_CHARS} Z85 characters)")
        mac_key = hmac.new(z85.decode(secret), _STORE_CONTEXT, _MAC).digest()
        return cls(secret, zmq.curve_public(secret), mac_key)

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls.from_secret(zmq.curve_keypair()[1])

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterKey:
        """The key in `path`. Raises ClusterKeyError, naming the file, when it cannot be read,
        is not a regular file, may be read or written by group or others, or holds no key."""
        text = read_private_file(
            path, limit=MAX_FILE_BYTES, what="cluster key file", how=MAKE_ONE, error=ClusterKeyError
        )
        try:
            return cls.from_secret(text)
        except ClusterKeyError as e:
            raise ClusterKeyError(f"cluster key file {path}: {e}") from None

    @classmethod
    def for_world(cls, several_nodes: bool, path: str | None) -> ClusterKey | None:
        """The key a world runs with: None on one node (nothing crosses a host), else the key
        in `path`, which several nodes cannot do without."""
        if not several_nodes:
            return None
        if path is None:
            raise ClusterKeyError(f"several nodes need --cluster-key-file: {MAKE_ONE}")
        return cls.load(path)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Create `path` (0600; never over an existing file or through a symlink)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret + b"\n")

    # ZMQ

    def server_options(self) -> list[tuple[int, Any]]:
        """Options for a socket that binds: CurveZMQ server with the cluster's key pair."""
        return [
            (zmq.CURVE_SERVER, 1),
            (zmq.CURVE_SECRETKEY, self.secret),
            (zmq.CURVE_PUBLICKEY, self.public),
            (zmq.ZAP_DOMAIN, b"triode-cluster"),
        ]

    def client_options(self) -> list[tuple[int, Any]]:
        """Options for a socket that connects: the cluster's key pair, and the server's key."""
        return [
            (zmq.CURVE_SERVERKEY, self.public),
            (zmq.CURVE_PUBLICKEY, self.public),
            (zmq.CURVE_SECRETKEY, self.secret),
        ]

    # the store

    def seal(self, name: str, value: bytes) -> bytes:
        """`value` with an HMAC over it and the store key `name` it is published under."""
        return self._mac(name, value) + value

    def open(self, name: str, sealed: bytes) -> bytes:
        """The value of `seal(name, value)`. Raises ProtocolError for anything else (another
        key's value, a value changed in the store, one sealed with another cluster key)."""
        if len(sealed) > MAX_SEALED_BYTES:
            raise ProtocolError(f"the store's {name!r} holds {len(sealed)} bytes, not a value")
        mac, value = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, self._mac(name, value)):
            raise ProtocolError(f"the store's {name!r} is not sealed with this cluster's key")
        return value

    def _mac(self, name: str, value: bytes) -> bytes:
        message = len(name).to_bytes(4, "big") + name.encode() + value
        return hmac.new(self._mac_key, message, _MAC).digest()


def apply_options(sock: zmq.Socket, options: list[tuple[int, Any]]) -> None:
    for option, value in options:
        sock.setsockopt(option, value)


class ClusterGate:
    """The ZAP handler of one ZMQ context: admits a CurveZMQ client only when it proves the
    cluster's key pair. A thread, from `start` to `close`; `refused` counts the clients turned
    away (a client without the Curve handshake never gets this far: libzmq drops it)."""

    def __init__(self, context: zmq.Context, key: ClusterKey) -> None:
        self._public = z85.decode(key.public)
        self._handler = context.socket(zmq.REP)
        self._handler.setsockopt(zmq.LINGER, 0)
        self._handler.bind(_ZAP_ENDPOINT)
        self._stop_endpoint = f"inproc://triode-cluster-gate-{id(self)}"
        self._stop_receiver = context.socket(zmq.PAIR)
        self._stop_receiver.bind(self._stop_endpoint)
        self._stop_sender = context.socket(zmq.PAIR)
        self._stop_sender.connect(self._stop_endpoint)
        self._lock = threading.Lock()
        self.refused = 0
        self.admitted = 0
        self._thread = threading.Thread(target=self._serve, name="cluster-gate", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._handler, zmq.POLLIN)
        poller.register(self._stop_receiver, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_receiver in ready:
                    return
                if self._handler in ready:
                    self._handler.send_multipart(self._answer(self._handler.recv_multipart()))
        finally:
            self._handler.close(linger=0)
            self._stop_receiver.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: version, request id, domain, address, identity, mechanism, credentials."""
        version = request[0] if request else b"1.0"
        request_id = request[1] if len(request) > 1 else b""
        allowed = (
            len(request) == 7
            and request[5] == b"CURVE"
            and hmac.compare_digest(request[6], self._public)
        )
        with self._lock:
            if allowed:
                self.admitted += 1
            else:
                self.refused += 1
        status = (b"200", b"OK") if allowed else (b"400", b"not a member of this cluster")
        return [version, request_id, *status, b"", b""]

    def close(self) -> None:
        """Stop the handler thread (before its context is terminated). Idempotent."""
        if self._stop_sender.closed:
            return
        self._stop_sender.send(b"")
        self._thread.join()
        self._stop_sender.close(linger=0)
