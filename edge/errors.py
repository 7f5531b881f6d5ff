"""The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import msgspec

from triode.actors import EngineDeadError, EngineRestarting, RequestError, RequestRefused

log = logging.getLogger(__name__)

# vLLM's type names for the statuses the edge returns.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# msgspec appends the location of a validation failure: "... - at `$.messages[0].role`".
_AT = re.compile(r"(?s)(?P<detail>.*) - at `\$(?P<path>[^`]*)`")
_FIELD_NAMED = re.compile(
    r"Object (?P<what>missing required|contains unknown) field `(?P<name>[^`]*)`"
)
# `SamplingParams` and other `__post_init__` checks raise ValueError("field: why").
_FIELD_WHY = re.compile(r"(?s)(?P<name>[A-Za-z_][A-Za-z0-9_]*): (?P<why>.*)")


class APIError(Exception):
    """An error to return to the client as an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else _default_type(status)
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or []  # sent with the error response (e.g. Retry-After)

    def __repr__(self) -> str:
        return (
            f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r})"
        )


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encoder = msgspec.json.Encoder()


def error_body(err: APIError) -> bytes:
    """The JSON body for `err`; `param` and `code` are always present, null when unset."""
    detail = _ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code)
    return _encoder.encode(_ErrorBody(error=detail))


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError | ValueError) -> APIError:
    """A 400 for a request body that failed to decode or validate, naming the field in `param`.

    Invalid JSON gives "invalid JSON: ..." with no `param`. Otherwise the message starts with the
    field path (`messages[0].role: ...`) whenever one is known.
    """
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"invalid JSON: {text}")
    path: str | None = None
    detail = text
    if (at := _AT.fullmatch(text)) is not None:
        detail = at["detail"]
        path = at["path"].removeprefix(".") or None
    if (named := _FIELD_NAMED.fullmatch(detail)) is not None:
        path = _join(path, named["name"])
        why = "missing required field" if named["what"] == "missing required" else "unknown field"
        return APIError(400, f"{path}: {why}", param=path)
    if (field := _FIELD_WHY.fullmatch(detail)) is not None:
        path = _join(path, field["name"])
        detail = field["why"]
    if path is None:
        return APIError(400, detail)
    return APIError(400, f"{path}: {detail}", param=path)


def leaf_errors(error: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, however nested (`error` itself otherwise)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaf_errors(e)]
    return [error]


def _join(path: str | None, name: str) -> str:
    return f"{path}.{name}" if path else name


def _default_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "InternalServerError" if status >= 500 else "BadRequestError"


def engine_error(error: BaseException) -> APIError:
    """The client's answer when the engine refused or could not run a request: 503 for a dead
    engine, 429 with Retry-After for a full queue, 400 for a refused request, else 500."""
    if isinstance(error, EngineDeadError):
        return _engine_dead(error)
    if isinstance(error, RequestRefused):
        return too_busy(str(error), error.retry_after)
    if isinstance(error, RequestError):
        return validation_error(error)
    # the text of an unexpected exception may name files, hosts or internals: it goes to the
    # log, the client gets the fact
    log.error("generation failed: %s", error)
    return APIError(500, "generation failed; the server log has the details")


def too_busy(message: str, retry_after: float = 1.0) -> APIError:
    """A 429 telling the client when to try again."""
    return APIError(429, message, headers=[_retry_after(retry_after)])


def _retry_after(seconds: float) -> tuple[bytes, bytes]:
    """RFC 9110's Retry-After: whole seconds, at least one."""
    return b"retry-after", str(max(1, math.ceil(seconds))).encode()


def check_engine_alive(engine: Any) -> None:
    """A 503 unless the engine is running."""
    if engine.dead is not None:
        raise _engine_dead(engine.dead)


def _engine_dead(error: EngineDeadError) -> APIError:
    """503; while another engine core starts in a dead one's place, with Retry-After. Why it
    died (a remote traceback, an exit status) is for the operator's log, which has it."""
    if isinstance(error, EngineRestarting):
        # the client's own words (`core_client`), with nothing of the dead process in them
        return APIError(503, str(error), headers=[_retry_after(error.retry_after)])
    return APIError(503, "the engine is not running")
