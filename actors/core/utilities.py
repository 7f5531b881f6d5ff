"""The engine core's UTILITY calls: each answered by name, in order, or, for an operation that
acts (`operations.py`, `loras.py`), in a task of its own."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec

from triode.wire import EngineCoreOutputs, UtilityCall, UtilityOutput
from triode.wire.operations import OperationError

from . import loras
from .operations import EngineOperations

if TYPE_CHECKING:
    from .engine_core import EngineCore

log = logging.getLogger(__name__)


def describe(core: EngineCore) -> dict[str, Any]:
    """Who answers: the process and what it said READY with. A client that lost its engine
    core asks the one started in its place, at the same addresses, before it sends anything
    else (`core_client.py`)."""
    ready = None if core.ready is None else msgspec.to_builtins(core.ready)
    return {"pid": os.getpid(), "ready": ready}


# the engine core's own questions, answered by its methods of these names
QUESTIONS = ("get_stats", "seconds_stalled")


async def call_utility(core: EngineCore, call: UtilityCall) -> None:
    """A utility method, answered in order; an operation that acts, which may take long (a
    pause that waits, new weights), in a task of its own, so that inputs (aborts among them)
    keep coming in meanwhile: its answer may come after those of later calls."""
    method: Any = None
    if call.method == "describe":
        method = describe
    elif call.method in QUESTIONS:
        method = getattr(type(core), call.method)
    if method is not None:
        await _answer(core, call, method, core)
    elif call.method in EngineOperations.METHODS or call.method in loras.METHODS:
        owner: Any = core.operations
        if call.method in loras.METHODS:
            owner = core.loras
        method = getattr(type(owner), call.method)
        if inspect.iscoroutinefunction(method):
            core.spawn(functools.partial(_answer, core, call, method, owner))
        else:  # a question about the state: answered in order, like the rest
            await _answer(core, call, method, owner)
    else:
        result = UtilityOutput(call.call_id)
        result.failure_message = f"unknown utility method {call.method!r}"
        await core.publish(call.client_index, EngineCoreOutputs(utility_output=result))


async def _answer(core: EngineCore, call: UtilityCall, method: Any, owner: Any) -> None:
    result = UtilityOutput(call.call_id)
    try:
        inspect.signature(method).bind(owner, *call.args)
    except TypeError as e:  # arguments the method does not take
        result.failure_message, result.failure_kind = f"{call.method}: {e}", "invalid"
        await core.publish(call.client_index, EngineCoreOutputs(utility_output=result))
        return
    try:
        answer = method(owner, *call.args)
        result.result = await answer if inspect.isawaitable(answer) else answer
    except OperationError as e:
        result.failure_message, result.failure_kind = e.message, e.kind
    except Exception as e:
        log.exception("%s failed", call.method)
        result.failure_message = f"{call.method} failed: {type(e).__name__}: {e}"
    core.publish_kv_events()  # an operation may have cleared the cache
    await core.publish(call.client_index, EngineCoreOutputs(utility_output=result))
