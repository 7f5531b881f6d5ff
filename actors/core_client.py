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
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from triode.wire import (
    Encoder,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreRequestType,
    OutputDecoder,
    ProtocolError,
    Ready,
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
# what a client is told to wait while an engine core starts again (about its start time)
RESTART_RETRY_AFTER = 5.0
# how often a client whose engine core died asks, at its addresses, who is there now
DESCRIBE_INTERVAL = 2.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; nothing sent to it will be answered."""


class EngineRestarting(EngineDeadError):
    """The engine core died and another is starting in its place: the same call may succeed
    after `retry_after` seconds."""

    retry_after = RESTART_RETRY_AFTER


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
        ready: Ready | None = None,
        reopen: Callable[[], tuple[Socket, Socket]] | None = None,
    ) -> None:
        self._input = input_socket
        self._output = output_socket
        self._child = process
        # what the engine core said READY with; another's once one is started in its place
        self.ready = ready or Ready()
        # fresh sockets to the engine core's addresses: given where a dead one is started
        # again there (`launcher.open_engine_cores`), which this client then waits for
        self._reopen = reopen
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
        self._expected_seq = 0

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def load(self) -> int:
        """The engine's queue as this client knows it: its running and waiting requests at
        its last stats, and what this client has sent since."""
        return self.stats.num_running_reqs + self.stats.num_waiting_reqs + self._sent_since_stats

    @property
    def incarnation(self) -> int:
        """How often this engine core was started again (0: the first one runs)."""
        return int(self.ready.info.get("incarnation") or 0)

    async def run(self) -> None:
        """Run the intake and fan-out until the engine core dies, then fail what it had; where
        another is started in its place, connect to that one and go on. Until cancelled, or
        a death with none to follow."""
        while True:
            async with trio.open_nursery() as nursery:
                if isinstance(self._child, Peer):
                    nursery.start_soon(self._child.watch)
                nursery.start_soon(self._intake)
                nursery.start_soon(self._fan_out)
                await self._child.exited.wait()
                nursery.cancel_scope.cancel()
            self._died()
            if self._reopen is None:
                return
            await self._reconnect(self._reopen)

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
        while True:
            frames = await self._output.recv_multipart()
            try:
                _, outputs = decoder.decode([f.buffer for f in frames])
            except ProtocolError as e:
                self.protocol_errors += 1
                log.warning("dropped an undecodable output message: %s", e)
                continue
            if outputs.seq != self._expected_seq:
                self._lost(outputs.seq - self._expected_seq)
            self._expected_seq = outputs.seq + 1
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

    def _died(self) -> None:
        """The engine core is gone: its requests and calls fail at once, and so does what
        comes later (`EngineRestarting` while another is starting in its place)."""
        error: EngineDeadError
        if self._reopen is None:
            error = self.dead = EngineDeadError(f"the engine core died: {self._child.error}")
        else:
            error = EngineRestarting(
                "the engine core died during this request and is starting again; retry shortly"
            )
            self.dead = EngineRestarting("the engine is restarting; retry shortly")
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        for done, box in self._calls.values():
            box.append(error)
            done.set()
        self._calls.clear()
        while True:  # what was on its way to the dead one goes nowhere
            try:
                self._intake_recv.receive_nowait()
            except trio.WouldBlock:
                break
        self.stats = SchedulerStats()
        self._sent_since_stats = 0

    async def _reconnect(self, reopen: Callable[[], tuple[Socket, Socket]]) -> None:
        """Fresh sockets to the same addresses, then ask, until one answers, which engine core
        is there now (`describe`): its pid is watched from then on, its READY replaces the
        dead one's, and its outputs' sequence starts after the answer."""
        self._input.close()
        self._output.close()
        self._input, self._output = reopen()
        decoder = OutputDecoder()
        asked: set[int] = set()
        while True:
            call_id = next(self._call_ids)
            asked.add(call_id)
            call = UtilityCall(call_id, "describe", [], client_index=self.client_index)
            await self._input.send_multipart(
                encode_input(self._encoder, EngineCoreRequestType.UTILITY, call), copy=False
            )
            with trio.move_on_after(DESCRIBE_INTERVAL):
                described, seq = await self._description(decoder, asked)
                break
        self.ready = msgspec.convert(described["ready"], Ready)
        self._child = Peer(f"engine-core-{self.engine_index}", described["pid"])
        self._expected_seq = seq + 1
        self.dead = None
        log.warning(
            "engine core %d is back (pid %d, restart %d)",
            self.engine_index,
            self._child.pid,
            self.incarnation,
        )

    async def _description(
        self, decoder: OutputDecoder, asked: set[int]
    ) -> tuple[dict[str, Any], int]:
        """The first answer to one of the `describe` calls `asked`, and its sequence number;
        what comes before it is dropped (no request of this client's is in that engine core)."""
        while True:
            frames = await self._output.recv_multipart()
            try:
                _, outputs = decoder.decode([f.buffer for f in frames])
            except ProtocolError:
                self.protocol_errors += 1
                continue
            answer = outputs.utility_output
            if answer is None or answer.call_id not in asked:
                continue
            if isinstance(answer.result, dict) and answer.result.get("ready"):
                return answer.result, outputs.seq

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
