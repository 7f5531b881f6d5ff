"""Messages on the control socket between a parent and a child process.

HELLO (child -> parent) -> CONFIG (parent -> child) -> READY (child -> parent); afterwards the
parent may send SHUTDOWN and the child may send ERROR before it exits. The control socket carries
a tagged union, so one decoder reads every message.
"""

from __future__ import annotations

import traceback
from typing import Any

import msgspec

# Bump when a change to any message breaks a peer built from an older tree.
PROTOCOL_VERSION = 1


class Hello(msgspec.Struct, tag="hello", omit_defaults=True):
    protocol_version: int
    pid: int
    name: str = ""


class Config(msgspec.Struct, tag="config", omit_defaults=True):
    """The parent's answer to HELLO: where to connect and what to run with."""

    addresses: dict[str, str] = {}
    options: dict[str, Any] = {}


class Ready(msgspec.Struct, tag="ready", omit_defaults=True):
    """The child is serving. Engine cores fill in the KV-cache geometry."""

    num_kv_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    info: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="shutdown", omit_defaults=True):
    reason: str = ""


class Error(msgspec.Struct, tag="error", omit_defaults=True):
    """An exception, boxed as data so it can cross a process boundary."""

    type_name: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> Error:
        return cls(
            type_name=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )


ControlMessage = Hello | Config | Ready | Shutdown | Error
