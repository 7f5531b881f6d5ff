"""The client side of an engine core: its input edge, the fan-out actor, utility calls.

The fan-out task is the single owner of the SUB socket: it decodes each `EngineCoreOutputs`,
checks the topic's sequence number, and routes every output to its request's stream without
ever blocking (a slow consumer's outputs coalesce in its stream). The intake task is the single
owner of the PUSH socket. When the engine process dies, every stream fails with
`EngineDeadError` at once and later calls raise it immediately.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import trio

from triode.wire import (
    Encoder,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreRequestType,
    OutputDecoder,
    ProtocolError,
    SchedulerStats,
    Socket,
    UtilityCall,
    encode_input,
)
from triode.wire.operations import OPERATION_ERROR_KINDS, OperationError

from .peer import Peer
from .process import Child

log = logging.getLogger(__name__)

ABORT_TIMEOUT = 1.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; nothing sent to it will be answered."""


class RequestStream:
    """Outputs of one request, buffered without bound on the producer side: the fan-out never
    waits for a consumer, and a consumer that falls behind takes everything pending at once."""

    def __init__(self) -> None:
        self._pending: list[EngineCoreOutput] = []
        self._changed = trio.Event()
        self._error: BaseException | None = None

    def put(self, output: EngineCoreOutput) -> None:
        self._pending.append(output)
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._changed.set()

    async def get(self) -> list[EngineCoreOutput]:
        """Everything pending, waiting for at least one output. A checkpoint."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            await self._changed.wait()
            self._changed = trio.Event()
        await trio.lowlevel.checkpoint()
        out, self._pending = self._pending, []
        return out


class EngineCoreClient:
    """One client's line to one engine core. `process` is the core as a `Child` of this
    process, or as a `Peer` (a process started by the same parent), which `run` watches."""

    def __init__(
        self,
        input_socket: Socket,
        output_socket: Socket,
        process: Child | Peer,
        *,
        client_index: int = 0,
        engine_index: int = 0,
    ) -> None:
        self._input = input_socket
        self._output = output_socket
        self._child = process
        self.client_index = client_index
        self.engine_index = engine_index
        # requests sent since the engine's last stats: they are not in its queue lengths yet
        self._sent_since_stats = 0
        self._encoder = Encoder()
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, tuple[trio.Event, list[Any]]] = {}
        self._call_ids = itertools.count()
        self._intake_send, self._intake_recv = trio.open_memory_channel[list[Any]](256)
        self.dead: EngineDeadError | None = None
        self.protocol_errors = 0
        self.sequence_gaps = 0
        self.stats = SchedulerStats()

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def load(self) -> int:
        """The engine's queue as this client knows it: its running and waiting requests at
        its last stats, and what this client has sent since."""
        return self.stats.num_running_reqs + self.stats.num_waiting_reqs + self._sent_since_stats

    async def run(self) -> None:
        """Run the intake, fan-out and death watch until cancelled."""
        async with trio.open_nursery() as nursery:
            if isinstance(self._child, Peer):
                nursery.start_soon(self._child.watch)
            nursery.start_soon(self._intake)
            nursery.start_soon(self._fan_out)
            nursery.start_soon(self._watch_engine)

    async def add_request(
        self, request: EngineCoreRequest, stream: RequestStream | None = None
    ) -> RequestStream:
        """Register the request's stream (several requests may share one), then send the
        request. A checkpoint; cancelled means the request was not sent."""
        self._check_alive()
        stream = self._streams[request.request_id] = stream or RequestStream()
        request.client_index = self.client_index
        try:
            await self._send(EngineCoreRequestType.ADD_REQUEST, request)
        except BaseException:
            del self._streams[request.request_id]
            raise
        self._sent_since_stats += 1
        return stream

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in the engine (idempotent there). Bounded in time and safe to call from a
        cancelled scope: call it from a shielded `finally`."""
        for rid in request_ids:
            self._streams.pop(rid, None)
        if not request_ids or self.dead is not None:
            return
        with trio.move_on_after(ABORT_TIMEOUT):
            try:
                await self._send(EngineCoreRequestType.ABORT_REQUEST, list(request_ids))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the client is shutting down; the engine goes with it

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method in the engine core and wait for its result."""
        self._check_alive()
        call_id = next(self._call_ids)
        done, box = self._calls[call_id] = (trio.Event(), [])
        try:
            await self._send(
                EngineCoreRequestType.UTILITY,
                UtilityCall(call_id, method, list(args), client_index=self.client_index),
            )
            await done.wait()
        finally:
            self._calls.pop(call_id, None)
        [outcome] = box
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        await self._intake_send.send(encode_input(self._encoder, kind, payload))

    async def _intake(self) -> None:
        async for frames in self._intake_recv:
            await self._input.send_multipart(frames, copy=False)

    async def _fan_out(self) -> None:
        decoder = OutputDecoder()
        expected_seq = 0
        while True:
            frames = await self._output.recv_multipart()
            try:
                _, outputs = decoder.decode([f.buffer for f in frames])
            except ProtocolError as e:
                self.protocol_errors += 1
                log.warning("dropped an undecodable output message: %s", e)
                continue
            if outputs.seq != expected_seq:
                self._lost(outputs.seq - expected_seq)
            expected_seq = outputs.seq + 1
            if outputs.scheduler_stats is not None:
                self.stats = outputs.scheduler_stats
                self._sent_since_stats = 0
            if outputs.utility_output is not None:
                self._resolve(outputs.utility_output)
            for output in outputs.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        del self._streams[output.request_id]

    def _lost(self, count: int) -> None:
        """A sequence gap: outputs were dropped, so any in-flight request may be missing
        tokens. Fail them all rather than let one hang or return wrong text."""
        self.sequence_gaps += 1
        log.error("lost %d output message(s) from the engine; failing in-flight requests", count)
        error = RuntimeError(f"lost {count} output message(s) from the engine")
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()

    def _resolve(self, result: Any) -> None:
        call = self._calls.get(result.call_id)
        if call is None:
            return
        done, box = call
        if result.failure_message is not None and result.failure_kind in OPERATION_ERROR_KINDS:
            box.append(OperationError(result.failure_kind, result.failure_message))
        elif result.failure_message is not None:
            box.append(RuntimeError(result.failure_message))
        else:
            box.append(result.result)
        done.set()

    async def _watch_engine(self) -> None:
        await self._child.exited.wait()
        self.dead = EngineDeadError(f"the engine core died: {self._child.error}")
        for stream in self._streams.values():
            stream.fail(self.dead)
        self._streams.clear()
        for done, box in self._calls.values():
            box.append(self.dead)
            done.set()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
