"""The engine core: the scheduler actor's step loop and its input and output edges (the
process's entry, which builds one, is `main.py`).

Input arrives on a PULL socket (`[type, msgpack, *aux]`), outputs leave on an XPUB socket
(`[topic, msgpack, *aux]` per client), whose one owner is the publisher (`publisher.py`): a
client whose subscription ends (its process died) has its requests aborted. The forward pass
runs off the trio loop (on one thread, or in worker processes: `executor.py`), so requests and
aborts are taken in while the model computes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np
import trio

from triode.wire import (
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
)

from ..prompt_embeds import receive_prompt_embeds
from ..vocabulary import out_of_vocabulary
from .executor import Executor
from .kv_events import KVEventPublisher
from .loras import LoRARegistry, LoRASettings
from .operations import EngineOperations
from .publisher import Publisher
from .scheduler import Scheduler
from .standing import StandingFile, standing_of
from .utilities import call_utility

log = logging.getLogger(__name__)

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
        profiler_dir: str | None = None,
        world_size: int = 1,
        lora: LoRASettings | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.scheduler = scheduler
        # where the cache's changes go after each step (`kv_events.py`), when they are published;
        # the scheduler's cache records them in its `log`
        self.kv_events = kv_events
        self.executor = executor
        # what the sockets carry goes here too while the engine records (--record-wire)
        self.recorder = recorder
        self.num_clients = num_clients
        self.engine_index = engine_index
        self.data_parallel_size = data_parallel_size
        self._stats_sent = 0.0
        self.structured = scheduler.structured
        # constrained requests whose grammar is compiling, and their clients
        self._compiling: dict[str, int] = {}
        self.grammar_errors = 0
        self.protocol_errors = 0
        self.steps = 0
        self.overlapped_steps = 0  # steps submitted while an earlier one was in flight
        # why no new step may start (`operations.Hold`: asleep, paused, an operation on the
        # workers); the step loop parks, with no step in flight, while any is held
        self.holds: set[str] = set()
        self._parked = trio.Event()  # set while parked
        self.operations = EngineOperations(self, profiler_dir=profiler_dir, world_size=world_size)
        # the LoRA adapters, which the scheduler asks which waiting requests may start
        self.loras = LoRARegistry(self, lora or LoRASettings())
        scheduler.loras = self.loras
        # when the engine core last made progress (trio's clock): a step, or work coming to
        # an idle loop
        self._progress_at = 0.0
        self._work = trio.Event()
        self._outbox, self._publisher_inbox = trio.open_memory_channel[
            tuple[int, EngineCoreOutputs]
        ](64)
        # where the adapters and weights the operator gave are kept for a restart (`standing`)
        self.standing: StandingFile | None = None
        self.ready: Ready | None = None  # what it said READY with (the `describe` call's)

    def record_standing(self) -> None:
        """Keep the adapters and weights served now for an engine core started in this one's
        place (`standing.py`)."""
        if self.standing is not None:
            self.standing.write(standing_of(self))

    async def run(self, input_socket: Socket, output_socket: Socket) -> None:
        self._progress_at = trio.current_time()
        publisher = Publisher(
            output_socket,
            self._publisher_inbox,
            num_clients=self.num_clients,
            engine_index=self.engine_index,
            on_unsubscribed=self._orphaned,
            recorder=self.recorder,
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(publisher.run)
            if self.kv_events is not None:
                await nursery.start(self.kv_events.run)
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
                while self.holds or not (
                    self.scheduler.has_unfinished_requests()
                    or self.scheduler.has_pending_transfers()
                ):
                    idle = True
                    self._parked.set()
                    await self._wait_for_input()
                if idle:  # a stall counts from when the work came, not from the last step
                    self._parked = trio.Event()
                    self._progress_at = trio.current_time()
            if len(in_flight) < depth and not self.holds and self._another_step(len(in_flight)):
                started = time.perf_counter()
                scheduler_output = self.scheduler.schedule(
                    max_requests=self._micro_batch(depth), preempt=not in_flight
                )
                # blocks are registered as they are scheduled: a router hears of them while
                # the step computes them, not a step later
                self.publish_kv_events()
                self.loras.tend()  # load what waiting requests want, drop what none holds
                if scheduler_output.requests or scheduler_output.kv_connector_metadata:
                    self.operations.timeline.scheduled(scheduler_output)
                    if depth == 1:
                        output = await self.executor.execute(
                            scheduler_output, self.scheduler.fill_bitmask
                        )
                        await self._publish_step(scheduler_output, output)
                        if self.scheduler.drafter is not None:
                            seconds = time.perf_counter() - started
                            self.scheduler.drafter.observe_step(scheduler_output, seconds)
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

    def _another_step(self, in_flight: int) -> bool:
        """Whether to start a step beside the `in_flight` ones: one per pipeline stage; an
        encoder's second only for a backlog of half a step's tokens, a smaller one waits to
        join the next step rather than make a step of its own."""
        config = self.scheduler.config
        if not in_flight or not config.whole_prompts:
            return True
        return 2 * self.scheduler.waiting_tokens() >= config.max_num_batched_tokens

    def _micro_batch(self, depth: int) -> int | None:
        """The most requests one step takes: an equal share of the live ones per stage."""
        if depth == 1 or self.scheduler.config.whole_prompts:  # steps in flight, no stages
            return None
        return max(1, -(-len(self.scheduler.requests) // depth))

    async def _publish_step(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        self.steps += 1
        self._progress_at = trio.current_time()
        self.operations.timeline.done(scheduler_output)
        per_client = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.operations.check_drained()
        self.loras.tend()
        stats = self.scheduler.get_stats()
        for client, outputs in per_client.items():
            outputs.scheduler_stats = stats
            await self.publish(client, outputs)
        self.publish_kv_events()
        await self._broadcast_stats(stats, per_client)

    def publish_kv_events(self) -> None:
        """The cache's changes since the last step (or operation) to the KV-event publisher."""
        if self.kv_events is not None:
            self.kv_events.flush()

    async def publish(self, client: int, outputs: EngineCoreOutputs) -> None:
        """A step's outputs to the publisher without a checkpoint while its inbox has room:
        the step loop goes on to hand the next step to the model before the publisher encodes
        and sends these, which then happens while the model computes."""
        try:
            self._outbox.send_nowait((client, outputs))
        except trio.WouldBlock:
            await self._outbox.send((client, outputs))

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

    async def hold(self, reason: str) -> None:
        """Start no new step for `reason` until `release`; returns once no step is in flight
        (the workers are then free for a call)."""
        self.holds.add(reason)
        self._work.set()
        await self._parked.wait()

    def spawn(self, task: Any) -> None:
        """Run `task` beside the step loop and the input actor, until the engine stops."""
        self._nursery.start_soon(task)

    def release(self, reason: str) -> None:
        self.holds.discard(reason)
        self._work.set()

    async def tell(self, told: list[tuple[int, EngineCoreOutput]]) -> None:
        """Send outputs the engine decided on its own (aborts) to their requests' clients."""
        per_client: dict[int, list[EngineCoreOutput]] = {}
        for client, output in told:
            per_client.setdefault(client, []).append(output)
        stats = self.scheduler.get_stats()
        for client, outputs in per_client.items():
            finished = [o.request_id for o in outputs]
            told_outputs = EngineCoreOutputs(
                outputs=outputs, scheduler_stats=stats, finished_requests=finished
            )
            await self._outbox.send((client, told_outputs))

    def abort_compiling(self) -> list[tuple[int, EngineCoreOutput]]:
        """Drop the requests whose grammar is still compiling (they are not queued yet): what
        tells their clients."""
        told = [
            (client, EngineCoreOutput(request_id, finish_reason=FinishReason.ABORT))
            for request_id, client in self._compiling.items()
        ]
        self._compiling.clear()
        return told

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
                for request_id in payload:
                    self._compiling.pop(request_id, None)
                self.scheduler.abort_requests(payload)
                self.loras.tend()
            else:
                assert isinstance(payload, UtilityCall)
                await call_utility(self, payload)
            self._work.set()
            self.operations.check_drained()

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
        if problem is None and request.lora_name is not None:
            if self.loras.resolve(request.lora_name) is None:
                problem = _not_loaded(request.lora_name)
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
                self._compiling[request.request_id] = request.client_index
                self._nursery.start_soon(self._compile_then_add, request, embeds)
                return
        rejected = (
            EngineCoreOutput(
                request.request_id, finish_reason=FinishReason.ERROR, stop_reason=problem
            )
            if problem
            else self._queue(request, None, embeds)
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
        del self._compiling[request.request_id]
        if rejected is None:
            rejected = self._queue(request, grammar, embeds)
        await self._reject(request, rejected)
        self._work.set()

    def _queue(
        self, request: EngineCoreRequest, grammar: Any, embeds: np.ndarray | None
    ) -> EngineCoreOutput | None:
        """Queue the request with its LoRA adapter's entry, resolved now (it may have been
        unloaded while the request's grammar compiled)."""
        lora = None
        if request.lora_name is not None:
            lora = self.loras.resolve(request.lora_name)
            if lora is None:
                return EngineCoreOutput(
                    request.request_id,
                    finish_reason=FinishReason.ERROR,
                    stop_reason=_not_loaded(request.lora_name),
                )
        return self.scheduler.add_request(request, grammar, embeds, lora)

    async def _reject(self, request: EngineCoreRequest, rejected: EngineCoreOutput | None) -> None:
        if rejected is not None:
            outputs = EngineCoreOutputs(
                outputs=[rejected],
                finished_requests=[request.request_id],
                scheduler_stats=self.scheduler.get_stats(),
            )
            await self._outbox.send((request.client_index, outputs))

    def _orphaned(self, client: int) -> None:
        """A client's subscription ended (its process died): its requests are aborted."""
        orphans = [
            r.request_id for r in self.scheduler.requests.values() if r.client_index == client
        ]
        if orphans:
            log.warning("client %d unsubscribed; aborting its %d request(s)", client, len(orphans))
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
            "loras_resident": len(self.loras.resident),
            "lora_loads": self.loras.loads,
            "lora_evictions": self.loras.evictions,
            **({} if self.scheduler.drafter is None else self.scheduler.drafter.stats()),
        }

    def seconds_stalled(self) -> float:
        """How long the engine core has made no step while it has requests to work on: 0
        with none, or held (asleep, paused: it is told to take no steps then)."""
        if self.holds or not self.scheduler.has_unfinished_requests():
            return 0.0
        return trio.current_time() - self._progress_at


def _not_loaded(name: str) -> str:
    return f"the LoRA adapter {name!r} is not loaded"
