"""The engine-core process: scheduler actor, input and output edges, the step loop.

Input arrives on a PULL socket (`[type, msgpack, *aux]`), outputs leave on an XPUB socket
(`[topic, msgpack, *aux]` per client). XPUB rather than PUB because it reports subscriptions:
an expected client's outputs wait until its SUB is confirmed, so none is published into the
void (ZMQ's slow-joiner problem), and a client whose subscription ends (its process died) has
its requests aborted. The forward pass runs off the trio loop
(on one thread, or in worker processes: `executor.py`), so requests and aborts are taken in while
the model computes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio
import zmq

from triode.wire import (
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    InputDecoder,
    ModelRunnerOutput,
    ProtocolError,
    Ready,
    Recorder,
    SchedulerOutput,
    SchedulerStats,
    Socket,
    UtilityCall,
    UtilityOutput,
    encode_output,
    open_recorder,
)
from triode.wire.framing import client_of_topic
from triode.wire.kv_transfer import parse_kv_transfer_config

from ..child import ChildContext
from ..config import EngineArgs
from ..prompt_embeds import receive_prompt_embeds
from ..vocabulary import out_of_vocabulary
from .executor import Executor, open_executor
from .kv_connector import KVConnectorScheduler
from .scheduler import Scheduler, SchedulerConfig
from .structured_output import StructuredOutputManager

log = logging.getLogger(__name__)

# PUB drops at its high-water mark; this is far above what a healthy client lags behind by,
# and sequence numbers catch the rest.
OUTPUT_HWM = 100_000
# How many messages wait for an expected client whose SUB is not confirmed yet (a restarted
# edge's first request can overtake its subscription); beyond that the oldest drop, and the
# client sees the gap in its sequence numbers.
MAX_HELD_OUTPUTS = 10_000
# How often an engine with several clients, or one of several engines, tells every client its
# queue lengths (the edges balance requests over engines by them).
STATS_INTERVAL = 0.05
# how often an engine with nothing to compute steps while a KV transfer is outstanding, to
# hear of its end from the workers
KV_POLL_INTERVAL = 0.005


class EngineCore:
    """Owns the scheduler and the executor; the step loop and the input actor share them, both
    on the trio thread, so the scheduler needs no locks."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        num_clients: int = 1,
        engine_index: int = 0,
        data_parallel_size: int = 1,
        recorder: Recorder | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # what the sockets carry goes here too while the engine records (--record-wire)
        self.recorder = recorder
        self.num_clients = num_clients
        self.engine_index = engine_index
        self.data_parallel_size = data_parallel_size
        self._stats_sent = 0.0
        self.structured = scheduler.structured
        self._compiling: set[str] = set()  # constrained requests whose grammar is compiling
        self.grammar_errors = 0
        self.protocol_errors = 0
        self.steps = 0
        self.overlapped_steps = 0  # steps submitted while an earlier one was in flight
        self.sleeping = False
        # when the engine core last made progress (trio's clock): a step, or work coming to
        # an idle loop
        self._progress_at = 0.0
        self._work = trio.Event()
        self._outbox, self._publisher_inbox = trio.open_memory_channel[
            tuple[int, EngineCoreOutputs]
        ](64)

    async def run(self, input_socket: Socket, output_socket: Socket) -> None:
        self._progress_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._publish, output_socket)
            nursery.start_soon(self._receive, input_socket)
            await self._step_loop()

    async def _step_loop(self) -> None:
        """Schedule, execute, publish. With pipeline parallelism the executor takes up to one
        step per stage at a time (vLLM's batch queue): while stage 1 computes step N, stage 0
        computes step N + 1 over the requests that step N does not hold, so the running
        requests go through the pipeline as micro-batches."""
        depth = self.executor.max_concurrent_batches
        in_flight: deque[SchedulerOutput] = deque()
        while True:
            if not in_flight:
                idle = False
                while self.sleeping or not (
                    self.scheduler.has_unfinished_requests()
                    or self.scheduler.has_pending_transfers()
                ):
                    idle = True
                    await self._wait_for_input()
                if idle:  # a stall counts from when the work came, not from the last step
                    self._progress_at = trio.current_time()
            if len(in_flight) < depth and not self.sleeping:
                scheduler_output = self.scheduler.schedule(
                    max_requests=self._micro_batch(depth), preempt=not in_flight
                )
                if scheduler_output.requests or scheduler_output.kv_connector_metadata:
                    if depth == 1:
                        output = await self.executor.execute(
                            scheduler_output, self.scheduler.fill_bitmask
                        )
                        await self._publish_step(scheduler_output, output)
                        if not scheduler_output.requests:  # the KV connector's poll
                            await self._poll_pause()
                        continue
                    await self.executor.submit(scheduler_output, self.scheduler.fill_bitmask)
                    self.overlapped_steps += bool(in_flight)
                    in_flight.append(scheduler_output)
                    if len(in_flight) < depth and scheduler_output.requests:
                        continue  # fill the pipeline first
            if not in_flight:
                # Nothing could be scheduled (e.g. all waiting requests are blocked); wait for
                # an input to change that rather than spin.
                await self._idle()
                continue
            scheduler_output = in_flight.popleft()
            output = await self.executor.receive(scheduler_output)
            await self._publish_step(scheduler_output, output)
            if not scheduler_output.requests and not in_flight:
                await self._poll_pause()

    def _micro_batch(self, depth: int) -> int | None:
        """The most requests one step takes: an equal share of the live ones per stage."""
        if depth == 1:
            return None
        return max(1, -(-len(self.scheduler.requests) // depth))

    async def _publish_step(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        self.steps += 1
        self._progress_at = trio.current_time()
        per_client = self.scheduler.update_from_output(scheduler_output, runner_output)
        stats = self.scheduler.get_stats()
        for client, outputs in per_client.items():
            outputs.scheduler_stats = stats
            await self._outbox.send((client, outputs))
        await self._broadcast_stats(stats, per_client)

    async def _poll_pause(self) -> None:
        """After a step that only polled the KV connector: a moment, or less if an input
        comes. Not longer: the poll may have made a request runnable (its KV loaded)."""
        with trio.move_on_after(KV_POLL_INTERVAL):
            await self._wait_for_input()

    async def _idle(self) -> None:
        """Wait for an input, or only a moment while KV transfers are outstanding."""
        if self.scheduler.has_pending_transfers():
            with trio.move_on_after(KV_POLL_INTERVAL):
                await self._wait_for_input()
        else:
            await self._wait_for_input()

    async def _wait_for_input(self) -> None:
        await self._work.wait()
        self._work = trio.Event()

    async def _receive(self, socket: Socket) -> None:
        decoder = InputDecoder()
        while True:
            frames = [f.buffer for f in await socket.recv_multipart()]
            if self.recorder is not None:
                self.recorder.record("in", frames)
            try:
                kind, payload = decoder.decode(frames)
            except ProtocolError as e:
                self.protocol_errors += 1
                log.warning("dropped an undecodable input message: %s", e)
                continue
            if kind is EngineCoreRequestType.ADD_REQUEST:
                assert isinstance(payload, EngineCoreRequest)
                await self._add(payload)
            elif kind is EngineCoreRequestType.ABORT_REQUEST:
                assert isinstance(payload, list)
                self._compiling.difference_update(payload)
                self.scheduler.abort_requests(payload)
            else:
                assert isinstance(payload, UtilityCall)
                await self._call_utility(payload)
            self._work.set()

    async def _add(self, request: EngineCoreRequest) -> None:
        if not request.arrival_time:
            request.arrival_time = time.time()
        embeds, problem = None, None
        if request.prompt_embeds is not None:  # copied out and unlinked on arrival
            try:
                embeds = receive_prompt_embeds(request.prompt_embeds, self.executor.hidden_size)
            except ValueError as e:
                problem = str(e)
        problem = problem or out_of_vocabulary(
            self.executor.vocab_size,
            prompt=request.prompt_token_ids,
            params=request.sampling_params,
        )
        if problem is None and request.sampling_params.structured_outputs is not None:
            if self.structured is None:
                problem = "structured_outputs: this model has no tokenizer.json to build grammars"
            elif request.request_id in self._compiling:
                problem = f"request id {request.request_id!r} is already in use"
            elif self.scheduler.waiting_full(len(self._compiling)):
                # refused before its grammar costs a compile
                await self._reject(request, self.scheduler.refusal(request.request_id))
                return
            else:
                self._compiling.add(request.request_id)
                self._nursery.start_soon(self._compile_then_add, request, embeds)
                return
        rejected = (
            EngineCoreOutput(
                request.request_id, finish_reason=FinishReason.ERROR, stop_reason=problem
            )
            if problem
            else self.scheduler.add_request(request, prompt_embeds=embeds)
        )
        await self._reject(request, rejected)

    async def _compile_then_add(
        self, request: EngineCoreRequest, embeds: np.ndarray | None = None
    ) -> None:
        """Compile a constrained request's grammar off the step loop, then queue the request;
        one aborted meanwhile is dropped."""
        assert self.structured is not None and request.sampling_params.structured_outputs
        try:
            grammar = await self.structured.compile(request.sampling_params.structured_outputs)
        except ValueError as e:
            self.grammar_errors += 1
            rejected = EngineCoreOutput(
                request.request_id, finish_reason=FinishReason.ERROR, stop_reason=str(e)
            )
        else:
            rejected = None
        if request.request_id not in self._compiling:  # aborted while compiling
            return
        self._compiling.discard(request.request_id)
        if rejected is None:
            rejected = self.scheduler.add_request(request, grammar, embeds)
        await self._reject(request, rejected)
        self._work.set()

    async def _reject(self, request: EngineCoreRequest, rejected: EngineCoreOutput | None) -> None:
        if rejected is not None:
            outputs = EngineCoreOutputs(
                outputs=[rejected],
                finished_requests=[request.request_id],
                scheduler_stats=self.scheduler.get_stats(),
            )
            await self._outbox.send((request.client_index, outputs))

    async def _call_utility(self, call: UtilityCall) -> None:
        result = UtilityOutput(call.call_id)
        method = _UTILITIES.get(call.method)
        if method is None:
            result.failure_message = f"unknown utility method {call.method!r}"
        else:
            try:
                result.result = method(self, *call.args)
            except Exception as e:
                result.failure_message = f"{call.method} failed: {type(e).__name__}: {e}"
        await self._outbox.send((call.client_index, EngineCoreOutputs(utility_output=result)))

    async def _publish(self, socket: Socket) -> None:
        """The XPUB socket's one owner: sends each client's outputs under its topic, and reads
        the subscriptions the socket reports. A client's topic carries nothing until its SUB
        is confirmed (messages wait, bounded, until then); a client whose subscription ends
        (its process died) has its requests aborted, and its topic starts again at sequence 0
        for whoever subscribes next."""
        encoder = Encoder()
        topics = _Topics(self.num_clients)
        while True:
            item, frames = await _next_output_or_subscription(self._publisher_inbox, socket)
            if frames is not None:
                self._take_subscription(topics, frames[0])
                for client, outputs in topics.released():
                    await self._send_output(socket, encoder, topics, client, outputs)
            if item is not None:
                client, outputs = item
                if topics.hold(client, outputs):
                    continue
                await self._send_output(socket, encoder, topics, client, outputs)

    async def _send_output(
        self,
        socket: Socket,
        encoder: Encoder,
        topics: _Topics,
        client: int,
        outputs: EngineCoreOutputs,
    ) -> None:
        outputs.engine_index = self.engine_index
        outputs.seq = topics.next_seq(client)
        outputs.timestamp = time.time()
        frames = encode_output(encoder, client, outputs)
        if self.recorder is not None:
            self.recorder.record("out", frames)
        await socket.send_multipart(frames)

    def _take_subscription(self, topics: _Topics, event: bytes) -> None:
        client = client_of_topic(event[1:])
        if client is None:
            return
        if event[:1] == b"\x01":
            topics.subscribed(client)
        elif event[:1] == b"\x00":
            topics.unsubscribed(client)
            orphans = [
                r.request_id for r in self.scheduler.requests.values() if r.client_index == client
            ]
            if orphans:
                log.warning(
                    "client %d unsubscribed; aborting its %d request(s)", client, len(orphans)
                )
                self.scheduler.abort_requests(orphans)
            self._work.set()

    async def _broadcast_stats(self, stats: SchedulerStats, skip: Iterable[int]) -> None:
        """Every expected client hears the engine's queue lengths at most `STATS_INTERVAL`
        apart, also those with no output this step: the edges balance over engines by them."""
        now = time.monotonic()
        if self.num_clients < 2 and self.data_parallel_size < 2:
            return
        if now - self._stats_sent < STATS_INTERVAL:
            return
        self._stats_sent = now
        for client in set(range(self.num_clients)).difference(skip):
            await self._outbox.send((client, EngineCoreOutputs(scheduler_stats=stats)))

    # Utility methods: called by name through UTILITY messages; results must be msgpack-able.

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.get_stats()
        named = {name: getattr(stats, name) for name in stats.__struct_fields__}
        return {
            **named,
            "protocol_errors": self.protocol_errors,
            "worker_protocol_errors": self.executor.protocol_errors,
            "steps": self.steps,
            "overlapped_steps": self.overlapped_steps,
            "grammars_compiling": len(self._compiling),
            "grammars_compiled": self.structured.compiled if self.structured else 0,
            "grammar_cache_hits": self.structured.cache_hits if self.structured else 0,
            "grammar_errors": self.grammar_errors,
        }

    def seconds_stalled(self) -> float:
        """How long the engine core has made no step while it has requests to work on: 0
        with none, or asleep (it is told to take no steps then)."""
        if self.sleeping or not self.scheduler.has_unfinished_requests():
            return 0.0
        return trio.current_time() - self._progress_at

    def sleep(self, level: int = 1) -> None:
        """Stop taking steps; requests wait (and keep their KV blocks) until `wake_up`."""
        self.sleeping = True

    def wake_up(self) -> None:
        self.sleeping = False

    def is_sleeping(self) -> bool:
        return self.sleeping


_UTILITIES = {
    name: getattr(EngineCore, name)
    for name in (
        "reset_prefix_cache",
        "get_stats",
        "sleep",
        "wake_up",
        "is_sleeping",
        "seconds_stalled",
    )
}


class _Topics:
    """The publisher's view of its clients' topics: sequence numbers, which of the expected
    clients (0 .. `expected` - 1) are subscribed, and what waits for those that are not. A
    client outside that range (a tool, a fuzzer) is sent to as it comes."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._seqs: dict[int, int] = {}
        self._subscribed: set[int] = set()
        self._held: dict[int, deque[EngineCoreOutputs]] = {}
        self._released: list[tuple[int, EngineCoreOutputs]] = []

    def hold(self, client: int, outputs: EngineCoreOutputs) -> bool:
        """Keep `outputs` back if its client is expected but not subscribed yet."""
        if client in self._subscribed or not 0 <= client < self.expected:
            return False
        held = self._held.setdefault(client, deque(maxlen=MAX_HELD_OUTPUTS))
        if len(held) == held.maxlen:
            self._seqs[client] = self._seqs.get(client, 0) + 1  # the dropped one's number
        held.append(outputs)
        return True

    def subscribed(self, client: int) -> None:
        self._subscribed.add(client)
        self._released.extend((client, o) for o in self._held.pop(client, ()))

    def unsubscribed(self, client: int) -> None:
        self._subscribed.discard(client)
        self._seqs.pop(client, None)
        self._held.pop(client, None)

    def released(self) -> list[tuple[int, EngineCoreOutputs]]:
        out, self._released = self._released, []
        return out

    def next_seq(self, client: int) -> int:
        seq = self._seqs.get(client, 0)
        self._seqs[client] = seq + 1
        return seq


async def _next_output_or_subscription(
    inbox: trio.MemoryReceiveChannel[tuple[int, EngineCoreOutputs]], socket: Socket
) -> tuple[tuple[int, EngineCoreOutputs] | None, list[bytes] | None]:
    """The next message to publish, or the next subscription event of the XPUB socket, or
    both when they come together; whichever is first, without losing the other."""
    try:
        return inbox.receive_nowait(), None
    except trio.WouldBlock:
        pass
    item: tuple[int, EngineCoreOutputs] | None = None
    frames: list[bytes] | None = None
    async with trio.open_nursery() as nursery:

        async def take_output() -> None:
            nonlocal item
            item = await inbox.receive()
            nursery.cancel_scope.cancel()

        async def take_subscription() -> None:
            nonlocal frames
            frames = await socket.recv_multipart(copy=True)
            nursery.cancel_scope.cancel()

        nursery.start_soon(take_output)
        nursery.start_soon(take_subscription)
    return item, frames


async def serve_engine_core(ctx: ChildContext) -> None:
    """The engine-core actor's entry (`triode.actors.core.engine_core:serve_engine_core`)."""
    args = msgspec.convert(ctx.options["engine_args"], EngineArgs)
    if ctx.options.get("cpus"):
        # one of several data-parallel engines: its share of the cores, which its model
        # threads (and its workers, who inherit it) size themselves by
        os.sched_setaffinity(0, ctx.options["cpus"])
    input_socket = Socket.open(ctx.zmq_context, zmq.PULL, bind=ctx.addresses["input"])
    output_socket = Socket.open(
        ctx.zmq_context, zmq.XPUB, bind=ctx.addresses["output"], hwm=OUTPUT_HWM
    )
    async with (
        input_socket,
        output_socket,
        _recording(ctx, args) as recorder,
        open_executor(args) as executor,
    ):
        connector = None
        if args.kv_transfer_config is not None:
            connector = KVConnectorScheduler(
                parse_kv_transfer_config(args.kv_transfer_config),
                block_size=executor.block_size,
                endpoints=executor.kv_endpoints,
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=args.pipeline_parallel_size,
            )
        tokenizer_file = Path(executor.model_dir) / "tokenizer.json"
        structured = None
        if tokenizer_file.is_file():
            eos_ids = [executor.eos_token_id, *executor.extra_eos_token_ids]
            structured = StructuredOutputManager(
                tokenizer_file, executor.vocab_size, [t for t in eos_ids if t is not None]
            )
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=executor.num_kv_blocks,
                block_size=executor.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_new_prompt_tokens=args.max_new_prompt_tokens,
                max_model_len=executor.max_model_len,
                enable_prefix_caching=args.enable_prefix_caching,
                max_waiting_requests=args.max_waiting_requests,
            ),
            connector,
            structured,
        )
        await ctx.ready(
            Ready(
                num_kv_blocks=executor.num_kv_blocks,
                block_size=executor.block_size,
                # A request can never outgrow the whole cache, whatever the model allows.
                max_model_len=scheduler.max_len,
                info={
                    "model_dir": str(executor.model_dir),
                    "eos_token_id": executor.eos_token_id,
                    "extra_eos_token_ids": executor.extra_eos_token_ids,
                    "vocab_size": executor.vocab_size,
                    "hidden_size": executor.hidden_size,
                    "dtype": executor.dtype,
                    "tensor_parallel_size": args.tensor_parallel_size,
                    "pipeline_parallel_size": args.pipeline_parallel_size,
                    "worker_pids": executor.worker_pids,
                    "kv_endpoints": executor.kv_endpoints,
                    # where the edges read the secret that the params they take must be
                    # sealed with: the path only, never the secret
                    "kv_secret_file": None if connector is None else connector.config.secret_file,
                },
            )
        )
        core = EngineCore(
            scheduler,
            executor,
            num_clients=ctx.options.get("num_clients", 1),
            engine_index=ctx.options.get("engine_index", 0),
            data_parallel_size=args.data_parallel_size,
            recorder=recorder,
        )
        await core.run(input_socket, output_socket)


def _recording(ctx: ChildContext, args: EngineArgs) -> AbstractAsyncContextManager[Recorder | None]:
    """The recording of this engine core's traffic that `--record-wire` asks for, else None.
    One of several data-parallel engines records into a directory of its own under it."""
    if args.record_wire is None:
        return nullcontext()
    directory = Path(args.record_wire)
    if args.data_parallel_size > 1:
        directory /= f"engine-{ctx.options.get('engine_index', 0)}"
    meta = {
        "engine_args": ctx.options["engine_args"],
        "num_clients": ctx.options.get("num_clients", 1),
        "engine_index": ctx.options.get("engine_index", 0),
    }
    return open_recorder(directory, meta)
