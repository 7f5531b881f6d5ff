"""The one door from the actors into `triode.gpu`: where the model runs.

The scheduler hands each step's `SchedulerOutput` to an executor and gets a `ModelRunnerOutput`
back. In a world of one (tensor x pipeline parallel size 1, backend `inproc`) the model runs in
this process, on one dedicated thread; otherwise (`mp`) in one worker process per rank
(`multiproc.py`), which this process starts and supervises.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio

from triode.wire import ModelRunnerOutput, SchedulerOutput

from ..config import EngineArgs
from .model_thread import ModelThread, Pending
from .multiproc import open_multiproc_executor

log = logging.getLogger(__name__)

# Fills a step's grammar bitmask in place (`Scheduler.fill_bitmask`).
FillBitmask = Callable[[SchedulerOutput], None]


class Executor(Protocol):
    model_dir: Path
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_id: int | None
    extra_eos_token_ids: list[int]
    vocab_size: int
    hidden_size: int  # what a prompt's embeddings must have per position
    dtype: str
    protocol_errors: int  # broadcast messages the workers could not decode
    # how many steps may be in flight at once: one per pipeline stage
    max_concurrent_batches: int
    worker_pids: list[int]  # this node's model worker processes
    kv_endpoints: list[str]  # each rank's KV server, with a KV connector; else empty
    # what the model pools (`PoolingSpec.as_dict`), when it is served for embeddings or scores
    pooling: dict[str, Any] | None
    is_encoder: bool  # no KV cache: each prompt is computed whole, in one step

    async def execute(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> ModelRunnerOutput:
        """Run one step. A step with constrained rows needs `fill_bitmask` run on it before
        its sampling, which an executor may overlap with the step's forward. A checkpoint;
        cancelling it leaves the step's effect on the KV cache undefined, which only happens
        when the engine stops."""
        ...

    async def submit(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> None:
        """Start a step without waiting for it (only where `max_concurrent_batches` > 1),
        its grammar bitmask filled first by `fill_bitmask` where it has constrained rows."""
        ...

    async def receive(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The result of the oldest submitted step, which must be `scheduler_output`."""
        ...

    async def call_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """`method` of every rank's `triode.gpu.operations.Operations`, only with no step in
        flight; each rank's result, in rank order. Calls from several tasks run one at a
        time. A rank's refusal raises its
        `OperationError`, any other failure a RuntimeError naming the rank."""
        ...


class InProcessExecutor:
    """Runs the model in this process, on its own thread beside the trio loop (`thread`,
    which builds it too: `open_executor`), a step at a time."""

    protocol_errors = 0
    max_concurrent_batches = 1
    worker_pids: list[int] = []  # the model runs in this process

    def __init__(self, args: EngineArgs, thread: ModelThread) -> None:
        # torch and the model, in this process only when the model runs here
        from triode.gpu.operations import Operations
        from triode.gpu.runners import open_runner

        started = time.perf_counter()
        log.info("loading %s (dtype %s)", args.model or "the default model", args.dtype)
        self._runner = open_runner(msgspec.to_builtins(args))
        self.model_dir = self._runner.model_dir
        self.num_kv_blocks = self._runner.num_kv_blocks
        self.block_size = self._runner.block_size
        self.max_model_len = self._runner.max_model_len
        self.eos_token_id = self._runner.eos_token_id
        self.extra_eos_token_ids = self._runner.extra_eos_token_ids
        self.vocab_size = self._runner.vocab_size
        self.hidden_size = self._runner.hidden_size
        self.dtype = str(self._runner.dtype).removeprefix("torch.")
        self.kv_endpoints = self._runner.kv_endpoints
        spec = self._runner.pooling_spec
        self.pooling: dict[str, Any] | None = None if spec is None else spec.as_dict()
        self.is_encoder = self._runner.whole_prompts
        log.info(
            "model loaded in %.1fs: %s%s, %d KV blocks of %d tokens",
            time.perf_counter() - started,
            self.dtype,
            f" ({self._runner.quantized_projections} projections as GGUF stores them)"
            if self._runner.quantized_projections
            else "",
            self.num_kv_blocks,
            self.block_size,
        )

        # An encoder's requests end with the step that computes them, so the next step never
        # waits for this one's results: two steps in flight keep the model's thread busy
        # while the engine core publishes one and schedules the next (a decoder's next step
        # needs the tokens this one samples).
        self.max_concurrent_batches = 2 if self.is_encoder else 1
        self._pending: dict[int, Pending[ModelRunnerOutput]] = {}
        self._operations = Operations(self._runner)
        self._thread = thread
        self._filler = trio.CapacityLimiter(1)
        self._overlap_bitmask = self._runner.device.type != "cpu"

    async def execute(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> ModelRunnerOutput:
        """The step on the model's thread. A grammar bitmask is filled on another thread: on
        an accelerator while the step's forward runs (the runner waits for it only when it is
        about to sample); on CPU first, since the forward's threads already take every core
        the model was given and a fill beside them measured no faster."""
        if not scheduler_output.grammar_request_ids:
            fill_bitmask = None
        if fill_bitmask is not None and self._overlap_bitmask:
            return await self._execute_beside_fill(scheduler_output, fill_bitmask)
        if fill_bitmask is not None:
            await trio.to_thread.run_sync(fill_bitmask, scheduler_output, limiter=self._filler)
        return await self._thread.run(self._runner.execute, scheduler_output)

    async def _execute_beside_fill(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask
    ) -> ModelRunnerOutput:
        filled: concurrent.futures.Future[None] = concurrent.futures.Future()

        def fill() -> None:
            try:
                fill_bitmask(scheduler_output)
            except BaseException as e:  # the runner raises it, where it waits
                filled.set_exception(e)
            else:
                filled.set_result(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.to_thread.run_sync, fill, limiter=self._filler))
            return await self._thread.run(self._runner.execute, scheduler_output, filled.result)

    async def submit(
        self, scheduler_output: SchedulerOutput, fill_bitmask: FillBitmask | None = None
    ) -> None:
        """Hand an encoder's step to the model's thread without waiting for it (see
        `max_concurrent_batches`). Not a checkpoint."""
        if self.max_concurrent_batches == 1:
            raise RuntimeError("this model runs one step at a time: call execute")
        assert not scheduler_output.grammar_request_ids, "an encoder samples nothing"
        pending = self._thread.start(self._runner.execute, scheduler_output)
        self._pending[scheduler_output.step] = pending

    async def receive(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A submitted step's output, once it ran. A checkpoint."""
        if scheduler_output.step not in self._pending:
            raise RuntimeError("this model runs one step at a time: call execute")
        return await self._pending.pop(scheduler_output.step).result()

    async def call_workers(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """On the model's thread, between steps, one call at a time; not abandoned when
        cancelled (an operation half done would leave the model in between)."""
        return [await self._thread.run(self._operations.call, method, kwargs)]

    def shutdown(self) -> None:
        self._operations.close()
        self._runner.shutdown()
        self._runner = None  # type: ignore[assignment]


def generation_defaults(args: EngineArgs, model_dir: Path) -> dict[str, Any]:
    """The request defaults of the model in `model_dir` as `args`' generation config flags
    choose them (`triode.gpu.generation_config`; no torch). ValueError for flags that cannot
    give any."""
    # here, not at the top: this module is the actors' one door into triode.gpu
    from triode.gpu.generation_config import DEFAULT_MODEL_CARD, request_defaults

    card = DEFAULT_MODEL_CARD if args.model is None else None
    return request_defaults(
        model_dir, args.generation_config, args.override_generation_config, card=card
    )


@asynccontextmanager
async def open_executor(args: EngineArgs) -> AsyncIterator[Executor]:
    """The executor `args` ask for, ready to execute. Leaving the block stops it (and its
    worker processes). With workers, one that dies or fails cancels the block and raises
    `WorkerDied` (in an exception group), having killed the other ranks."""
    if args.executor_backend == "inproc":
        thread = ModelThread()
        try:
            executor = await thread.run(InProcessExecutor, args, thread, abandon_on_cancel=True)
        except BaseException:
            thread.close(wait=False)  # after a load abandoned, once it ends
            raise
        try:
            yield executor
        finally:
            try:
                executor.shutdown()
            finally:
                thread.close()
        return
    async with open_multiproc_executor(args) as multiproc:
        yield multiproc
