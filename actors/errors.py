"""Errors the actor runtime raises in a parent about its children, and those an engine raises
about a request it does not take."""

from __future__ import annotations

from triode.wire import Error


def exception_leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside `group` and the groups nested in it, in order."""
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(exception_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


class ActorError(Exception):
    """Base of the runtime's errors about a child actor process."""


class HandshakeError(ActorError):
    """The child did not complete HELLO -> CONFIG -> READY (version mismatch, bad message,
    timeout)."""


class ActorDied(ActorError):
    """A child process exited while the parent still needed it."""

    def __init__(self, name: str, returncode: int | None) -> None:
        super().__init__(f"actor {name!r} exited unexpectedly with code {returncode}")
        self.name = name
        self.returncode = returncode


class RemoteError(ActorDied):
    """A child process failed with an exception; it arrives here as data.

    `type_name`, `remote_message` and `remote_traceback` are the child's; `str()` includes the
    remote traceback so a log line tells the whole story.
    """

    def __init__(self, name: str, returncode: int | None, error: Error) -> None:
        ActorError.__init__(
            self,
            f"actor {name!r} failed with {error.type_name}: {error.message}\n"
            f"--- remote traceback ---\n{error.traceback}",
        )
        self.name = name
        self.returncode = returncode
        self.type_name = error.type_name
        self.remote_message = error.message
        self.remote_traceback = error.traceback


class RequestError(ValueError):
    """The engine refused a request (for example, a prompt longer than the model can take)."""


class RequestRefused(RuntimeError):
    """The engine core did not take a request for now: its queue of waiting requests is full
    (`EngineArgs.max_waiting_requests`). The same request may succeed later; `retry_after` is
    the seconds a client should wait first."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
