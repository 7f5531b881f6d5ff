"""Replaying a wire recording against a fresh engine core: `replay(directory)`.

A recording (`--record-wire`, `triode.wire.Recorder`) holds every message an engine core took in
and sent out. `replay` starts an engine core with the recorded engine arguments, sends it the
recorded input messages in order and at their recorded pace, and compares what comes out with
what was recorded, request by request: the new token ids, then the finish reason. On settings
that make the engine deterministic (greedy or seeded sampling, float32) a difference names a
request whose computation changed, and the first position where the two runs part.

How many tokens a request had before an abort reached the engine (its client left, a stop
string matched) is a matter of timing: such a request is compared over the tokens both runs
produced. A request that the recording ends inside (the engine stopped) is compared over its
recorded tokens. A request whose ADD_REQUEST was rotated out of the recording is not compared.
An input that the recording took in only after the engine answered a utility call (a client
that loaded a LoRA adapter, then sent requests naming it) waits for that answer in the replay
too, whatever the speed: an operation runs in a task of its own, and would otherwise race the
inputs that followed it.

A recording is a file someone may hand over, so the engine arguments that reach past this host
or process are not taken from it unless the caller trusts it (`trust_recorded_args`): the
multi-node ones (`nnodes`, `node_rank`, `master_addr`, `master_port`, `cluster_key_file`: a
replay would join, or wait for, a rendezvous somewhere else, with a key file the recording
names), `kv_transfer_config` (it would open a KV port, or connect to a producer named in the
recording) and `kv_events_config` (it would bind the event ports the recording names). A
recording that sets any of them is refused, naming them, unless they are trusted or overridden.
A replay never records (`record_wire`) and always runs one engine core.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from triode.wire import (
    Encoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    InputDecoder,
    OutputDecoder,
    ProtocolError,
    Socket,
    UtilityCall,
    encode_input,
    read_meta,
    read_records,
    topic_for,
)

from .config import EngineArgs
from .core_client import EngineDeadError
from .launcher import EngineCoreEndpoint, open_engine_cores
from .process import Child

log = logging.getLogger(__name__)

# how long the engine core may take to answer on each recorded client topic, once READY
CONNECT_TIMEOUT = 30.0
# A topic outside the engine's expected clients drops what is sent before its subscription
# arrives: the round trip that confirms it is tried again this often (seconds).
_ROUND_TRIP_RETRY = 0.25


class Difference(msgspec.Struct, kw_only=True):
    """Where one request's replayed outputs first part from the recorded ones."""

    request_id: str
    # the position: a token's index, or the number of tokens where the finish reason differs
    index: int
    # what is there: a token id, a finish reason ("stop", "length", "abort", "error"), or
    # None where that run has nothing
    recorded: int | str | None
    replayed: int | str | None


class ReplayReport(msgspec.Struct, kw_only=True):
    """The comparison of a replay with its recording."""

    identical: int  # requests whose outputs agree
    differences: list[Difference]
    skipped: int = 0  # requests with recorded outputs whose ADD_REQUEST was rotated out
    inputs: int = 0  # recorded input messages sent to the engine core
    protocol_errors: int = 0  # recorded or replayed messages that did not decode
    seconds: float = 0.0  # from the first input sent until every request was through
    timed_out: bool = False  # `max_seconds` ran out before every request was through

    @property
    def ok(self) -> bool:
        return not self.differences and not self.timed_out


class _Outcome:
    """One request's outputs in one run."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishReason | None = None
        self.aborted = False  # an ABORT naming it was sent before it finished
        self.ended = False  # the engine listed it as finished (an abort shows only there)


class _Recording:
    """What a recording holds: its input messages, and each request's recorded outcome."""

    def __init__(self) -> None:
        self.inputs: list[tuple[float, list[bytes], list[str]]] = []  # time, frames, aborts
        # input index -> the utility calls (client, call id) answered before it came
        self.waits: dict[int, list[tuple[int, int]]] = {}
        self.outcomes: dict[str, _Outcome] = {}
        self.skipped: set[str] = set()
        self.topics: set[int] = set()
        self.protocol_errors = 0


def _read_recording(directory: Path) -> _Recording:
    """Parse the recording in `directory` (blocking: run it in a thread)."""
    recording = _Recording()
    inputs, outputs = InputDecoder(), OutputDecoder()
    unanswered: set[tuple[int, int]] = set()
    answered: list[tuple[int, int]] = []  # since the last input
    for record in read_records(directory):
        if record.direction == "in":
            if answered:
                recording.waits[len(recording.inputs)], answered = answered, []
            try:
                _, payload = inputs.decode(record.frames)
            except ProtocolError:
                recording.inputs.append((record.timestamp, record.frames, []))
                recording.protocol_errors += 1
                continue
            aborts = payload if isinstance(payload, list) else []
            recording.inputs.append((record.timestamp, record.frames, aborts))
            if isinstance(payload, EngineCoreRequest):
                recording.outcomes.setdefault(payload.request_id, _Outcome())
                recording.topics.add(payload.client_index)
            elif isinstance(payload, UtilityCall):
                recording.topics.add(payload.client_index)
                unanswered.add((payload.client_index, payload.call_id))
            for request_id in aborts:
                _note_abort(recording.outcomes.get(request_id))
        else:
            try:
                client, message = outputs.decode(record.frames)
            except ProtocolError:
                recording.protocol_errors += 1
                continue
            recording.topics.add(client)
            recording.skipped.update(_take(recording.outcomes, message))
            if message.utility_output is not None:
                call = (client, message.utility_output.call_id)
                if call in unanswered:
                    unanswered.discard(call)
                    answered.append(call)
    return recording


def _note_abort(outcome: _Outcome | None) -> None:
    if outcome is not None and outcome.finish is None:
        outcome.aborted = True


def _take(outcomes: Mapping[str, _Outcome], message: EngineCoreOutputs) -> set[str]:
    """Add `message`'s outputs to their requests' outcomes; the request ids it names that
    `outcomes` does not hold."""
    unknown = set()
    for output in message.outputs:
        outcome = outcomes.get(output.request_id)
        if outcome is None:
            unknown.add(output.request_id)
            continue
        outcome.tokens.extend(output.new_token_ids)
        if output.finish_reason is not None:
            outcome.finish = output.finish_reason
    for request_id in message.finished_requests or ():
        outcome = outcomes.get(request_id)
        if outcome is not None:
            outcome.ended = True
    return unknown


async def replay(
    directory: str | os.PathLike[str],
    *,
    model: str | None = None,
    speed: float = 1.0,
    max_seconds: float | None = None,
    trust_recorded_args: bool = False,
    **engine_arg_overrides: Any,
) -> ReplayReport:
    """Replay the recording in `directory` against a new engine core and compare its outputs.

    The engine core gets the recorded engine arguments, with `model` and `engine_arg_overrides`
    (`EngineArgs` fields) in their place where given. Inputs go out at the recorded intervals
    divided by `speed` (`math.inf`: as fast as possible); after the last, the replay waits for
    every recorded request to be through, at most `max_seconds` from the first input (the
    report then says `timed_out`). Cancelling it stops the engine core. Raises `ProtocolError`
    for a recording that is not one, `msgspec.ValidationError` for bad engine arguments, and,
    in an exception group, what `open_engine_cores` raises if the engine fails to start,
    `EngineDeadError` if it dies, and `trio.TooSlowError` if it does not answer on a recorded
    client topic within `CONNECT_TIMEOUT`. Raises `UntrustedRecordingError` (before anything
    starts) for recorded multi-node or KV-transfer arguments, unless `trust_recorded_args`.
    """
    if not speed > 0:
        raise ValueError("speed must be > 0 (math.inf: as fast as possible)")
    directory = Path(directory)
    meta = read_meta(directory)
    args = _replay_args(meta, model, engine_arg_overrides, trust_recorded_args=trust_recorded_args)
    recording = await trio.to_thread.run_sync(_read_recording, directory)
    num_clients = meta.get("num_clients", 1)
    async with open_engine_cores(args, num_clients=num_clients) as cores:
        [(endpoint, child)] = cores
        replayer = _Replayer(endpoint, recording)
        try:
            await replayer.run(child, speed, math.inf if max_seconds is None else max_seconds)
        finally:
            replayer.close()
    identical, differences = _compare(recording.outcomes, replayer.outcomes)
    return ReplayReport(
        identical=identical,
        differences=differences,
        skipped=len(recording.skipped),
        inputs=replayer.inputs_sent,
        protocol_errors=recording.protocol_errors + replayer.protocol_errors,
        seconds=round(replayer.seconds, 3),
        timed_out=replayer.timed_out,
    )


# Recorded engine arguments that reach past this host or process (see the module's docstring).
UNTRUSTED_ARGS = (
    "nnodes", "node_rank", "master_addr", "master_port", "cluster_key_file", "kv_transfer_config",
    "kv_events_config",
)  # fmt: skip


class UntrustedRecordingError(ValueError):
    """A recording asks for engine arguments a replay takes only when told to."""


def _replay_args(
    meta: Mapping[str, Any],
    model: str | None,
    overrides: Mapping[str, Any],
    *,
    trust_recorded_args: bool = False,
) -> EngineArgs:
    """The engine arguments a replay runs with: the recorded ones, for one engine core that
    records nothing, and then `model` and `overrides`. Raises `UntrustedRecordingError` for a
    recording that sets an `UNTRUSTED_ARGS` one (unless trusted, or overridden)."""
    recorded = meta.get("engine_args")
    if not isinstance(recorded, dict):
        raise ProtocolError("the recording's meta.json has no engine_args")
    if not trust_recorded_args:
        defaults = {f.name: f.default for f in msgspec.structs.fields(EngineArgs)}
        asked = [
            f"{name}={recorded[name]!r}"
            for name in UNTRUSTED_ARGS
            if name in recorded and name not in overrides and recorded[name] != defaults.get(name)
        ]
        if asked:
            raise UntrustedRecordingError(
                f"the recording asks for {', '.join(asked)}: multi-node and KV-transfer "
                "arguments are taken from a recording only when trusted "
                "(--trust-recorded-args), or give them yourself"
            )
    fields = {**recorded, "record_wire": None, "data_parallel_size": 1, **overrides}
    if model is not None:
        fields["model"] = model
    return msgspec.convert(fields, EngineArgs)


class _Replayer:
    """Drives one engine core through a recording's inputs and collects its outputs. The
    calling task owns the PUSH socket, the receiving task the SUB socket."""

    def __init__(self, endpoint: EngineCoreEndpoint, recording: _Recording) -> None:
        self.recording = recording
        self.outcomes = {request_id: _Outcome() for request_id in recording.outcomes}
        self.inputs_sent = 0
        self.protocol_errors = 0
        self.seconds = 0.0
        self.timed_out = False
        self._zctx = zmq.Context()
        self._push = Socket.open(self._zctx, zmq.PUSH, connect=endpoint.input)
        self._sub = Socket.open(self._zctx, zmq.SUB, connect=endpoint.output)
        self.topics = sorted(recording.topics) or [0]
        for topic in self.topics:
            self._sub.zmq_socket.setsockopt(zmq.SUBSCRIBE, topic_for(topic))
        self._encoder = Encoder()
        self._call_ids = itertools.count(-1, -1)  # the recording's own calls count up from 0
        self._answers: dict[int, trio.Event] = {}
        self._answered: set[tuple[int, int]] = set()  # the recorded calls' (client, call id)
        self._changed = trio.Event()

    def close(self) -> None:
        self._push.close()
        self._sub.close()
        self._zctx.term()

    async def run(self, child: Child, speed: float, max_seconds: float) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive)
            nursery.start_soon(_watch, child)
            with trio.fail_after(CONNECT_TIMEOUT):
                for topic in self.topics:
                    await self._round_trip(topic)
            start = trio.current_time()
            with trio.move_on_after(max_seconds) as scope:
                await self._send_inputs(speed)
                await self._round_trip(self.topics[0])  # every input is taken in
                await self._settle()
            self.timed_out = scope.cancelled_caught
            self.seconds = trio.current_time() - start
            nursery.cancel_scope.cancel()

    async def _send_inputs(self, speed: float) -> None:
        inputs = self.recording.inputs
        first = inputs[0][0] if inputs else 0.0
        start = trio.current_time()
        for i, (timestamp, frames, aborts) in enumerate(inputs):
            for call in self.recording.waits.get(i, ()):
                await self._answer_of(call)
            await trio.sleep_until(start + (timestamp - first) / speed)
            await self._push.send_multipart(frames)
            self.inputs_sent += 1
            for request_id in aborts:
                _note_abort(self.outcomes.get(request_id))

    async def _settle(self) -> None:
        """Until every recorded request is through in this run as far as the recording goes."""
        while True:
            changed = self._changed
            if all(self._through(request_id) for request_id in self.outcomes):
                return
            await changed.wait()

    async def _answer_of(self, call: tuple[int, int]) -> None:
        """Until the engine core answered the recorded utility call `call`."""
        while True:
            changed = self._changed
            if call in self._answered:
                return
            await changed.wait()

    def _through(self, request_id: str) -> bool:
        replayed = self.outcomes[request_id]
        recorded = self.recording.outcomes[request_id]
        if replayed.finish is not None or replayed.ended or replayed.aborted:
            return True
        # the recording ends inside this request: its recorded tokens are all there is
        return recorded.finish is None and len(replayed.tokens) >= len(recorded.tokens)

    async def _round_trip(self, topic: int) -> None:
        """Until the engine core answers a harmless utility call on `topic`: it has then taken
        in everything sent before, and this socket's subscription to `topic` is live."""
        call_id = next(self._call_ids)
        answered = self._answers[call_id] = trio.Event()
        call = UtilityCall(call_id, "is_sleeping", client_index=topic)
        frames = encode_input(self._encoder, EngineCoreRequestType.UTILITY, call)
        while not answered.is_set():
            await self._push.send_multipart(frames)
            with trio.move_on_after(_ROUND_TRIP_RETRY):
                await answered.wait()
        del self._answers[call_id]

    async def _receive(self) -> None:
        decoder = OutputDecoder()
        while True:
            frames = await self._sub.recv_multipart()
            try:
                client, message = decoder.decode([f.buffer for f in frames])
            except ProtocolError as e:
                self.protocol_errors += 1
                log.warning("replay: an undecodable output message: %s", e)
                continue
            _take(self.outcomes, message)
            if message.utility_output is not None:
                self._answered.add((client, message.utility_output.call_id))
                answered = self._answers.get(message.utility_output.call_id)
                if answered is not None:
                    answered.set()
            self._changed.set()
            self._changed = trio.Event()


async def _watch(child: Child) -> None:
    await child.exited.wait()
    raise EngineDeadError(f"the engine core died during the replay: {child.error}")


def _compare(
    recorded: Mapping[str, _Outcome], replayed: Mapping[str, _Outcome]
) -> tuple[int, list[Difference]]:
    """How many requests agree, and where each of the others first differs."""
    identical = 0
    differences = []
    for request_id, ours in recorded.items():
        difference = _first_difference(request_id, ours, replayed.get(request_id) or _Outcome())
        if difference is None:
            identical += 1
        else:
            differences.append(difference)
    return identical, differences


def _first_difference(request_id: str, recorded: _Outcome, replayed: _Outcome) -> Difference | None:
    expected: list[int | str] = list(recorded.tokens)
    got: list[int | str] = list(replayed.tokens)
    if recorded.finish is not None:
        expected.append(recorded.finish.name.lower())
        if replayed.finish is not None:
            got.append(replayed.finish.name.lower())
    elif recorded.aborted:
        shared = min(len(expected), len(got))
        expected, got = expected[:shared], got[:shared]
    else:
        got = got[: len(expected)]
    for index in range(max(len(expected), len(got))):
        ours = expected[index] if index < len(expected) else None
        theirs = got[index] if index < len(got) else None
        if ours != theirs:
            return Difference(request_id=request_id, index=index, recorded=ours, replayed=theirs)
    return None
