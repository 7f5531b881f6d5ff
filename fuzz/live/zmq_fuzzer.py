"""The ZMQ side of the live fuzzer: hostile messages straight into an engine core's input socket.

Beside the engine's own client, a second PUSH socket connects to the engine core's input address
and sends what `ZmqMutator` (`zmq_mutator.py`) draws. Each message is first decoded here with
the engine's own decoder, so the fuzzer knows how many the engine must count as protocol errors,
which requests it added (to abort them after each round) and which utility calls it must answer.

Invariants, checked after every round: the engine process runs; its `protocol_errors` grew by
exactly the number of undecodable messages; every utility call the fuzzer made was answered
once; every output published on the fuzzer's topic decodes and none is missing; once the
fuzzer's requests are aborted nothing runs or waits; a greedy canary generation returns the same
tokens as before the run; resident memory stays bounded. At the end every KV block is free.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from triode.actors import Engine, SamplingParams, open_engine
from triode.wire import (
    Encoder,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    OutputDecoder,
    ProtocolError,
    Socket,
    UtilityCall,
    encode_input,
    topic_for,
)

from .processes import MemoryWatch, alive
from .report import Report, Violation, crash_path
from .zmq_mutator import FUZZ_CLIENT, ZmqMutator

# A KV cache this small (256 blocks on tiny-random) makes the fuzzer's requests contend for
# blocks, so preemption and block reuse run too.
SMALL_KV_CACHE = "1MiB"
ROUND_SECONDS = 2.0
BATCH = 32  # messages between two synchronisations with the engine
ANSWER_TIMEOUT = 30.0
DRAIN_TIMEOUT = 15.0
CANARY_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
CANARY_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
_SYNC_BASE = 1 << 62  # call ids of the fuzzer's synchronisation calls
ADD, ABORT, UTILITY = (
    EngineCoreRequestType.ADD_REQUEST,
    EngineCoreRequestType.ABORT_REQUEST,
    EngineCoreRequestType.UTILITY,
)
ENGINE_STATS = ("steps", "num_preemptions", "prefix_cache_hits", "num_total_blocks")


class _Session:
    """The fuzzer's own sockets to one engine, and what the engine owes it."""

    def __init__(self, engine: Engine, report: Report) -> None:
        self.engine = engine
        self.report = report
        self.zctx = zmq.Context()
        self.push = Socket.open(self.zctx, zmq.PUSH, connect=engine.input_address)
        self.sub = Socket.open(
            self.zctx, zmq.SUB, connect=engine.output_address, subscribe=topic_for(FUZZ_CLIENT)
        )
        self.decoder = InputDecoder()
        self.encoder = Encoder()
        self.expected_errors = 0  # undecodable messages sent
        self.owed: Counter[int] = Counter()  # utility answers owed, by call id
        self.live: set[str] = set()  # ids of requests added, to abort
        self.sent: list[list[bytes]] = []  # this round's messages
        self.finishes: Counter[str] = Counter()
        self.problem: str | None = None  # found by the output reader
        self._syncs = 0
        self._answers: dict[int, Any] = {}
        self._answered = trio.Event()

    def close(self) -> None:
        self.push.close()
        self.sub.close()
        self.zctx.term()

    async def read_outputs(self) -> None:
        """Decode everything published on the fuzzer's topic; note what is wrong."""
        decoder = OutputDecoder()
        expected_seq = None
        while True:
            frames = await self.sub.recv_multipart()
            try:
                _, outputs = decoder.decode([f.buffer for f in frames])
            except ProtocolError as e:
                self.problem = f"the engine published an undecodable output: {e}"
                continue
            if expected_seq is not None and outputs.seq != expected_seq:
                self.problem = f"output sequence jumped from {expected_seq} to {outputs.seq}"
            expected_seq = outputs.seq + 1
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self.finishes[str(out.finish_reason)] += 1
            answer = outputs.utility_output
            if answer is None:
                continue
            if self.owed[answer.call_id] > 0:
                self.owed[answer.call_id] -= 1
                self._answered.set()
            elif answer.call_id > _SYNC_BASE:
                self._answers[answer.call_id] = answer
                self._answered.set()
            else:
                self.problem = f"an unasked-for utility answer (call id {answer.call_id})"

    async def send(self, kind: str, frames: list[bytes]) -> None:
        """Send one message unless it would act on the engine's own client or put the engine to
        sleep (by design, not a fault), noting what the engine must do with it."""
        frames = frames or [b""]  # ZMQ has no message of no frames
        try:
            what, payload = self.decoder.decode(frames)
        except ProtocolError:
            what, payload = None, None
        if isinstance(payload, UtilityCall):
            if payload.client_index != FUZZ_CLIENT or payload.method == "sleep":
                self.report.outcomes["skipped"] += 1
                return
            self.owed[payload.call_id] += 1
        self.report.sent[kind] += 1
        self.report.outcomes["protocol error" if what is None else str(what.name).lower()] += 1
        if what is None:
            self.expected_errors += 1
        elif isinstance(payload, EngineCoreRequest):
            self.live.add(payload.request_id)
        self.sent.append(frames)
        await self.push.send_multipart(frames)

    async def connected(self) -> None:
        """Wait until the engine's answers on the fuzzer's topic arrive (a SUB socket's
        subscription takes effect some time after it connects)."""
        for _ in range(100):
            try:
                await self.call("get_stats", within=0.1)
                return
            except Violation:
                continue
        raise Violation("no answer from the engine on the fuzzer's topic")

    async def call(self, method: str, *args: Any, within: float = ANSWER_TIMEOUT) -> Any:
        """A utility call through the fuzzer's socket: answered only once the engine has taken
        in everything the fuzzer sent before it."""
        self._syncs += 1
        call_id = _SYNC_BASE + self._syncs
        call = UtilityCall(call_id, method, list(args), FUZZ_CLIENT)
        await self.push.send_multipart(encode_input(self.encoder, UTILITY, call))
        with trio.move_on_after(within):
            while call_id not in self._answers:
                await self._answered.wait()
                self._answered = trio.Event()
            answer = self._answers.pop(call_id)
            if answer.failure_message is not None:
                raise Violation(f"{method} failed: {answer.failure_message}")
            return answer.result
        raise Violation(f"the engine did not answer {method} within {within:g} s")

    async def check(self, *, final: bool = False) -> dict[str, Any]:
        """Abort the fuzzer's requests and check the engine (with `final`, that every KV block
        is free too); return its stats."""
        if self.live:
            await self.push.send_multipart(encode_input(self.encoder, ABORT, sorted(self.live)))
            self.live.clear()
        stats = await self.call("get_stats")
        self.report.protocol_errors = stats["protocol_errors"]
        self.report.engine = {k: stats[k] for k in ENGINE_STATS if k in stats}
        if self.engine.dead is not None or not alive(self.engine.pid):
            raise Violation(f"the engine core died: {self.engine.dead}")
        if stats["protocol_errors"] != self.expected_errors:
            raise Violation(
                f"the engine counted {stats['protocol_errors']} protocol errors for "
                f"{self.expected_errors} undecodable messages"
            )
        # an operation that acts (wake_up) is answered when done, maybe after later calls
        with trio.move_on_after(ANSWER_TIMEOUT):
            while +self.owed:
                await self._answered.wait()
                self._answered = trio.Event()
        if owed := +self.owed:
            raise Violation(f"utility calls left unanswered: {dict(owed)}")
        if self.problem is not None:
            raise Violation(self.problem)
        if await self.call("is_sleeping"):
            raise Violation("the engine is asleep though nothing asked it to sleep")
        with trio.move_on_after(DRAIN_TIMEOUT):
            while stats["num_running_reqs"] or stats["num_waiting_reqs"]:
                await trio.sleep(0.05)
                stats = await self.call("get_stats")
            if final and (
                stats["num_free_blocks"] != stats["num_total_blocks"] or stats["kv_cache_usage"]
            ):
                raise Violation(
                    f"KV blocks held after every request ended: {stats['num_free_blocks']} of "
                    f"{stats['num_total_blocks']} free, usage {stats['kv_cache_usage']}"
                )
            return stats
        raise Violation(
            f"requests left after aborting all the fuzzer's: {stats['num_running_reqs']} "
            f"running, {stats['num_waiting_reqs']} waiting"
        )


async def canary(engine: Engine) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(CANARY_PROMPT, CANARY_PARAMS):
        tokens = out.outputs[0].token_ids
    return list(tokens)


async def fuzz_engine(
    model: str | None,
    seconds: float,
    seed: int,
    crash_dir: Path | None = None,
    **engine_args: Any,
) -> Report:
    """Fuzz a fresh engine core on `model` (with `engine_args`) for `seconds`; return the
    report."""
    report = Report("zmq", seed)
    async with open_engine(model, **engine_args) as engine:
        session = _Session(engine, report)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.read_outputs)
                started = time.perf_counter()
                try:
                    await _run(engine, session, seconds, seed, report, crash_dir)
                except Violation as v:
                    report.violations.append(v.message)
                    if v.reproducer is not None:
                        report.replay = f"python -m triode.fuzz.live replay {v.reproducer}"
                        if model is not None:
                            report.replay += f" --launch {model}"
                report.seconds = time.perf_counter() - started
                nursery.cancel_scope.cancel()
        finally:
            session.close()
    return report


async def _run(
    engine: Engine,
    session: _Session,
    seconds: float,
    seed: int,
    report: Report,
    crash_dir: Path | None,
) -> None:
    await session.connected()
    expected = await canary(engine)
    memory = MemoryWatch({"engine": engine.pid})
    mutator = ZmqMutator(random.Random(seed), engine.vocab_size, engine.max_model_len)
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        stop_at = min(deadline, trio.current_time() + ROUND_SECONDS)
        session.sent = []
        try:
            while trio.current_time() < stop_at:
                for _ in range(BATCH):
                    await session.send(*mutator.message())
                await session.call("get_stats")
            await session.check()
            if (tokens := await canary(engine)) != expected:
                raise Violation(f"the canary changed: {expected} -> {tokens}")
            if report.rounds == 0:
                memory.settle()
            elif (grown := memory.check()) is not None:
                raise Violation(grown)
        except Violation as v:
            v.reproducer = _write(session.sent, f"zmq-round{report.rounds + 1}", crash_dir)
            raise
        report.rounds += 1
    await session.check(final=True)
    for reason, count in session.finishes.items():
        report.outcomes[f"finished {reason}"] += count


def _write(messages: list[list[bytes]], name: str, directory: Path | None) -> Path:
    path = crash_path(name, directory).with_suffix(".zmq")
    path.write_bytes(msgspec.msgpack.encode(messages))
    return path


async def replay(path: Path, model: str | None, **engine_args: Any) -> int:
    """Send the messages of a `.zmq` crash file to a fresh engine (on `model`, with
    `engine_args`) and check the invariants."""
    messages = msgspec.msgpack.decode(await trio.Path(path).read_bytes(), type=list[list[bytes]])
    report = Report("zmq", 0)
    async with open_engine(model, **engine_args) as engine:
        session = _Session(engine, report)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.read_outputs)
                await session.connected()
                expected = await canary(engine)
                try:
                    for frames in messages:
                        await session.send("replay", frames)
                    await session.check()
                    if (tokens := await canary(engine)) != expected:
                        raise Violation(f"the canary changed: {expected} -> {tokens}")
                    stats = await session.check(final=True)
                except Violation as v:
                    print(f"{len(messages)} messages; violation: {v.message}")
                    return 1
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            session.close()
    print(f"{len(messages)} messages; invariants hold: {stats}")
    return 0
