"""Administrative operations: the calls an engine core makes on every model worker rank (sleep,
wake, new weights, profiling), and the error an operation refuses with.

The executor broadcasts `[WorkerMessageType.CALL, WorkerCall]` to every rank, only while no step
is in flight (the engine core parks its step loop first); every rank answers on the results
socket with `[CALL, WorkerReply]`, a one-byte first frame no step's answer (a msgpack array of
at least two bytes) can have.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .messages import _HOT

# How an operation was refused, which the edge turns into its HTTP status: `invalid` (400:
# the arguments are wrong: a path that is no checkpoint of this architecture, a tensor of the
# wrong name, shape or dtype), `conflict` (409: not now: a sleep while asleep, an update while
# another runs), `unsupported` (400: not with this server's configuration), `not_found` (404:
# what the call names does not exist: a LoRA adapter never loaded).
OperationErrorKind = Literal["invalid", "conflict", "unsupported", "not_found"]
OPERATION_ERROR_KINDS: tuple[OperationErrorKind, ...] = (
    "invalid",
    "conflict",
    "unsupported",
    "not_found",
)

# The largest method name a worker call may carry
MAX_METHOD = 64


class OperationError(Exception):
    """An operation refused: `kind` says how (`OperationErrorKind`), the message says what."""

    def __init__(self, kind: OperationErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: OperationErrorKind = kind
        self.message = message


class WorkerCall(msgspec.Struct, **_HOT):
    """A method of the rank's `triode.gpu.operations.Operations`, by name, with its keywords."""

    call_id: int
    method: str
    kwargs: dict[str, Any] = {}


class WorkerReply(msgspec.Struct, **_HOT):
    """One rank's answer to a `WorkerCall`: its result, or its failure (with the
    `OperationError` kind, when it was one)."""

    call_id: int
    rank: int
    result: Any = None
    error: str | None = None
    error_kind: str | None = None
