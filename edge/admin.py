"""The administrative endpoints, in vLLM's spelling: sleep and wake, pause and resume, the prefix
cache, profiling, new weights, the world size, and loading and unloading LoRA adapters. Served
only with `--enable-admin-api` (`Settings.enable_admin_api`); without it each of these paths is
a 404, like any unknown one. None of them is an open path (`auth.OPEN_PATHS`): with API keys
configured, each needs one, and the key is checked before the request is routed.

Arguments come in the query string (`/sleep?level=2&tags=weights`) or in a small JSON body.
Both are bounded before they are parsed: a query string of at most `MAX_QUERY_BYTES` bytes and
`MAX_QUERY_FIELDS` parameters, each of a name its route takes; a body of at most the settings'
`max_body_size`, decoded straight into a Struct. The engine core checks the arguments again.

A client that goes away does not stop an operation halfway. These handlers do not watch for
`http.disconnect`, and hypercorn does not cancel a handler whose connection closed, so the engine
call runs to its end and its answer is written to nobody; no timeout cuts it either (a pause that
waits for in-flight requests, or a weight update, takes as long as it takes). Only the server's
shutdown cancels the wait, and an engine core carries on with a call it was sent until it stops
with the server. A shield was the other choice; it would make a hung call hold up even a second
SIGINT.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeVar

import msgspec
import trio
from msgspec import Meta

from triode.actors import Engine, EngineDeadError, OperationError, lora_name_problem
from triode.wire.messages import MAX_LORA_NAME

from .errors import APIError, engine_error, validation_error
from .http import Request, respond_json

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger(__name__)

# The longest query string and the most parameters any route here takes: the longest real one
# (`level=2&tags=weights&tags=kv_cache`) is 35 bytes and 3 parameters. Larger ones are refused
# before they are split, so the largest input costs one length check.
MAX_QUERY_BYTES: Final = 1024
MAX_QUERY_FIELDS: Final = 8
# How long /v1/models waits for the engine's weight version before it gives the last one seen.
WEIGHT_VERSION_TIMEOUT: Final = 0.5

_LEVELS: Final = ("0", "1", "2")
_TAGS: Final = ("weights", "kv_cache")
_PAUSE_MODES: Final = ("abort", "wait", "keep")
_TRUE: Final = ("true", "1", "yes", "on")
_FALSE: Final = ("false", "0", "no", "off")


class Query:
    """A route's query parameters: at most `MAX_QUERY_FIELDS`, each named in `known`, read by
    the methods that check their values. Every refusal is a 400 naming the parameter."""

    def __init__(self, raw: bytes, known: Collection[str] = ()) -> None:
        if len(raw) > MAX_QUERY_BYTES:
            raise APIError(400, f"the query string is longer than {MAX_QUERY_BYTES} bytes")
        if raw.count(b"&") >= MAX_QUERY_FIELDS:
            raise APIError(400, f"the query string has more than {MAX_QUERY_FIELDS} parameters")
        try:
            pairs = urllib.parse.parse_qsl(
                raw.decode("ascii"), keep_blank_values=True, strict_parsing=True, errors="strict"
            )
        except UnicodeError:
            raise APIError(400, "the query string is not percent-encoded UTF-8") from None
        except ValueError as e:
            raise APIError(400, f"the query string is malformed: {e}") from None
        self._values: dict[str, list[str]] = {}
        for name, value in pairs:
            if name not in known:
                takes = f"; this route takes {', '.join(known)}" if known else ""
                raise APIError(400, f"{name}: unknown query parameter{takes}", param=name)
            self._values.setdefault(name, []).append(value)

    def one(self, name: str, choices: Collection[str], default: str) -> str:
        """The parameter's value, one of `choices` (`default` when it is not given)."""
        value = self._single(name)
        if value is None:
            return default
        if value not in choices:
            raise APIError(400, f"{name}: must be one of {', '.join(choices)}", param=name)
        return value

    def many(self, name: str, choices: Collection[str]) -> list[str] | None:
        """The parameter's values (it may repeat), each one of `choices`, repeats dropped;
        None when it is not given."""
        values = self._values.get(name)
        if values is None:
            return None
        for value in values:
            if value not in choices:
                raise APIError(400, f"{name}: each must be one of {', '.join(choices)}", param=name)
        return list(dict.fromkeys(values))

    def flag(self, name: str, default: bool) -> bool:
        """A true/false parameter (also 1/0, yes/no, on/off; in any case)."""
        value = self._single(name)
        if value is None:
            return default
        if value.lower() not in (*_TRUE, *_FALSE):
            raise APIError(400, f"{name}: must be true or false", param=name)
        return value.lower() in _TRUE

    def _single(self, name: str) -> str | None:
        values = self._values.get(name)
        if values is not None and len(values) > 1:
            raise APIError(400, f"{name}: given more than once", param=name)
        return None if values is None else values[0]


# Bodies


_ModelPath = Annotated[str, Meta(min_length=1, max_length=4096, pattern="^[^\x00]*$")]
_LoraName = Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME)]


class WeightsFromDisk(msgspec.Struct, forbid_unknown_fields=True):
    """A `POST /update_weights_from_disk` body."""

    model_path: _ModelPath


class TransferInit(msgspec.Struct, forbid_unknown_fields=True):
    """A `POST /init_weight_transfer_engine` body."""

    init_info: dict[str, Any]


class WeightsUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """A `POST /update_weights` body."""

    update_info: dict[str, Any]


class LoadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True):
    """A `POST /v1/load_lora_adapter` body; `load_inplace` replaces an adapter of that name."""

    lora_name: _LoraName
    lora_path: _ModelPath
    load_inplace: bool = False


class UnloadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True):
    """A `POST /v1/unload_lora_adapter` body. vLLM's `lora_int_id` is taken and not used: the
    engine numbers its adapters itself, and the name alone picks one."""

    lora_name: _LoraName
    lora_int_id: int | None = None


_BodyT = TypeVar(
    "_BodyT", WeightsFromDisk, TransferInit, WeightsUpdate, LoadLoraAdapter, UnloadLoraAdapter
)

_DECODERS: Final[dict[type, msgspec.json.Decoder[Any]]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (WeightsFromDisk, TransferInit, WeightsUpdate, LoadLoraAdapter, UnloadLoraAdapter)
}


async def _body(app: App, request: Request, kind: type[_BodyT]) -> _BodyT:
    """The request's body as `kind`; a 413 past the size limit, a 400 naming the field for
    anything that is not one."""
    Query(request.query)  # these routes take no query parameters
    body = await request.read_body(app.settings.max_body_size)
    try:
        decoded: _BodyT = _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, ValueError) as e:
        raise validation_error(e) from None
    except RecursionError:  # msgspec's limit on nesting in `Any` values
        raise APIError(400, "invalid JSON: nested too deeply") from None
    return decoded


# Engine calls


async def _call(request: Request, call: Awaitable[Any]) -> Any:
    """`call`'s result. A refusal is a 400 (`invalid`, `unsupported`), a 404 (`not_found`) or
    a 409 (`conflict`) with the engine's message, a dead engine a 503, any other failure a 500
    whose details go only to the log."""
    try:
        return await call
    except OperationError as e:
        if e.kind == "conflict":  # OpenAI's name for a 409, which nothing else here answers
            raise APIError(409, e.message, type="ConflictError", code=e.kind) from None
        if e.kind == "not_found":
            raise APIError(404, e.message, code=e.kind) from None
        raise APIError(400, e.message, code=e.kind) from None
    except EngineDeadError as e:
        raise engine_error(e) from None
    except RuntimeError as e:
        log.error("%s %s failed: %s", request.method, request.path, e)
        raise APIError(500, f"{request.path} failed; the server log has the details") from None


async def _answer(request: Request, call: Awaitable[Any], **logged: Any) -> None:
    """Log the operation, run it, and answer with its result (`{}` for none)."""
    log.info("%s %s %s", request.method, request.path, _args(logged))
    result = await _call(request, call)
    await respond_json(request.send, {} if result is None else result)


def _args(logged: dict[str, Any]) -> str:
    return " ".join(f"{name}={value!r}" for name, value in logged.items())


async def weight_version(engine: Engine, last: int) -> int:
    """The engine's weight version, or `last` (the last one seen) when the engine does not
    answer within `WEIGHT_VERSION_TIMEOUT` or cannot. Never raises; cancelling it leaves
    nothing behind (the engine's late answer is dropped)."""
    if engine.dead is not None:
        return last
    with trio.move_on_after(WEIGHT_VERSION_TIMEOUT):
        try:
            return await engine.admin.weight_version()
        except (OperationError, EngineDeadError, RuntimeError):
            pass
    return last


# Handlers


async def sleep(app: App, request: Request) -> None:
    query = Query(request.query, ("level", "tags"))
    level = int(query.one("level", _LEVELS, "1"))
    tags = query.many("tags", _TAGS)
    await _answer(request, app.engine.admin.sleep(level, tags), level=level, tags=tags)


async def wake_up(app: App, request: Request) -> None:
    tags = Query(request.query, ("tags",)).many("tags", _TAGS)
    await _answer(request, app.engine.admin.wake_up(tags), tags=tags)


async def is_sleeping(app: App, request: Request) -> None:
    Query(request.query)
    sleeping = await _call(request, app.engine.admin.is_sleeping())
    await respond_json(request.send, {"is_sleeping": bool(sleeping)})


async def pause(app: App, request: Request) -> None:
    mode = Query(request.query, ("mode",)).one("mode", _PAUSE_MODES, "abort")
    await _answer(request, app.engine.admin.pause(mode), mode=mode)


async def resume(app: App, request: Request) -> None:
    Query(request.query)
    await _answer(request, app.engine.admin.resume())


async def is_paused(app: App, request: Request) -> None:
    Query(request.query)
    paused = await _call(request, app.engine.admin.is_paused())
    await respond_json(request.send, {"is_paused": bool(paused)})


async def reset_prefix_cache(app: App, request: Request) -> None:
    Query(request.query)
    log.info("%s %s", request.method, request.path)
    reset = await _call(request, app.engine.admin.reset_prefix_cache())
    await respond_json(request.send, {"reset": bool(reset)})


async def start_profile(app: App, request: Request) -> None:
    Query(request.query)
    await _answer(request, app.engine.admin.start_profile())


async def stop_profile(app: App, request: Request) -> None:
    Query(request.query)
    await _answer(request, app.engine.admin.stop_profile())


async def update_weights_from_disk(app: App, request: Request) -> None:
    body = await _body(app, request, WeightsFromDisk)
    call = app.engine.admin.update_weights_from_disk(body.model_path)
    await _answer(request, call, model_path=body.model_path)


async def init_weight_transfer_engine(app: App, request: Request) -> None:
    body = await _body(app, request, TransferInit)
    call = app.engine.admin.init_weight_transfer_engine(body.init_info)
    await _answer(request, call, backend=body.init_info.get("backend"))


async def start_weight_update(app: App, request: Request) -> None:
    Query(request.query)
    await _answer(request, app.engine.admin.start_weight_update())


async def update_weights(app: App, request: Request) -> None:
    body = await _body(app, request, WeightsUpdate)
    await _answer(request, app.engine.admin.update_weights(body.update_info))


async def finish_weight_update(app: App, request: Request) -> None:
    Query(request.query)
    await _answer(request, app.engine.admin.finish_weight_update())


async def get_world_size(app: App, request: Request) -> None:
    include_dp = Query(request.query, ("include_dp",)).flag("include_dp", True)
    engine = app.engine
    size = engine.tensor_parallel_size * engine.pipeline_parallel_size
    if include_dp:
        size *= engine.data_parallel_size
    await respond_json(request.send, {"world_size": size})


async def load_lora_adapter(app: App, request: Request) -> None:
    body = await _body(app, request, LoadLoraAdapter)
    _check_lora_name(app, body.lora_name)
    call = app.engine.admin.load_lora_adapter(body.lora_name, body.lora_path, body.load_inplace)
    await _answer_lora(
        app, request, call, lora_name=body.lora_name, lora_path=body.lora_path,
        load_inplace=body.load_inplace,
    )  # fmt: skip


async def unload_lora_adapter(app: App, request: Request) -> None:
    body = await _body(app, request, UnloadLoraAdapter)
    _check_lora_name(app, body.lora_name)
    call = app.engine.admin.unload_lora_adapter(body.lora_name)
    await _answer_lora(app, request, call, lora_name=body.lora_name)


async def _answer_lora(app: App, request: Request, call: Awaitable[Any], **logged: Any) -> None:
    """`_answer` for a load or unload, with this server's adapter names refreshed before the
    answer goes out: a client that names the adapter next finds it (or no longer). Refreshed
    after a refusal too, which may come from another server's change (a name it loaded)."""
    log.info("%s %s %s", request.method, request.path, _args(logged))
    try:
        result = await _call(request, call)
    finally:
        await app.loras.refresh()
    await respond_json(request.send, result)


def _check_lora_name(app: App, lora_name: str) -> None:
    """A 400 for a name no adapter can have (the engine's rule), or one of a served model: a
    request naming that runs the base model."""
    problem = lora_name_problem(lora_name)
    if problem is not None:
        raise APIError(400, f"lora_name: {problem}", param="lora_name")
    if lora_name in app.settings.served_model_names:
        raise APIError(400, f"lora_name: {lora_name!r} is a served model name", param="lora_name")


ADMIN_ROUTES: Final[dict[str, dict[str, Callable[[App, Request], Awaitable[None]]]]] = {
    "/sleep": {"POST": sleep},
    "/wake_up": {"POST": wake_up},
    "/is_sleeping": {"GET": is_sleeping},
    "/pause": {"POST": pause},
    "/resume": {"POST": resume},
    "/is_paused": {"GET": is_paused},
    "/reset_prefix_cache": {"POST": reset_prefix_cache},
    "/start_profile": {"POST": start_profile},
    "/stop_profile": {"POST": stop_profile},
    "/update_weights_from_disk": {"POST": update_weights_from_disk},
    "/init_weight_transfer_engine": {"POST": init_weight_transfer_engine},
    "/start_weight_update": {"POST": start_weight_update},
    "/update_weights": {"POST": update_weights},
    "/finish_weight_update": {"POST": finish_weight_update},
    "/get_world_size": {"GET": get_world_size},
    "/v1/load_lora_adapter": {"POST": load_lora_adapter},
    "/v1/unload_lora_adapter": {"POST": unload_lora_adapter},
}
