"""The engine-core process's main: `serve_engine_core`, the actor that a server starts (as
`triode.actors.core.main:serve_engine_core`, `launcher.py`) for each of its engine cores.

It binds the engine core's input (PULL) and output (XPUB) sockets, opens the executor (and with
it the model, or its worker processes), builds the scheduler with its KV connector and
structured output manager to fit, loads the `--lora-modules` adapters on the ranks, says READY
with what clients need to know of the model and the cache, and runs an `EngineCore`
(`engine_core.py`) until it is cancelled.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import Any

import msgspec
import zmq

from triode.wire import Ready, Recorder, Socket, open_recorder
from triode.wire.kv_transfer import parse_kv_transfer_config

from ..child import ChildContext
from ..config import EngineArgs
from .engine_core import EngineCore
from .executor import generation_defaults, open_executor
from .kv_connector import KVConnectorScheduler
from .kv_events import KVEventPublisher, parse_kv_events_config
from .loras import LoRASettings
from .publisher import OUTPUT_HWM
from .scheduler import Scheduler
from .scheduler_config import SchedulerConfig
from .speculation.config import parse_speculative_config
from .speculation.drafter import Drafter
from .standing import StandingFile, restore
from .structured_output import StructuredOutputManager

log = logging.getLogger(__name__)


async def serve_engine_core(ctx: ChildContext) -> None:
    """The engine-core actor's entry (`triode.actors.core.main:serve_engine_core`)."""
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
        defaults = generation_defaults(args, Path(executor.model_dir))
        if ctx.options.get("engine_index", 0) == 0:
            log.info(
                "request defaults (where a request leaves them unset): %s",
                describe_defaults(defaults, args),
            )
        tokenizer_file = Path(executor.model_dir) / "tokenizer.json"
        structured = None
        if tokenizer_file.is_file():
            eos_ids = [executor.eos_token_id, *executor.extra_eos_token_ids]
            structured = StructuredOutputManager(
                tokenizer_file, executor.vocab_size, [t for t in eos_ids if t is not None]
            )
        events_config = (
            None if args.kv_events_config is None else parse_kv_events_config(args.kv_events_config)
        )
        kv_events = None
        if events_config is not None and events_config.publishes:
            rank = ctx.options.get("engine_index", 0)
            kv_events = KVEventPublisher(
                events_config,
                ctx.zmq_context,
                block_size=executor.block_size,
                data_parallel_rank=rank,
            )
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=executor.num_kv_blocks,
                block_size=executor.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_new_prompt_tokens=args.max_new_prompt_tokens,
                max_model_len=executor.max_model_len,
                # an encoder's blocks hold nothing to share
                enable_prefix_caching=args.enable_prefix_caching and not executor.is_encoder,
                max_waiting_requests=args.max_waiting_requests,
                pooling_tasks=frozenset([executor.pooling["task"]] if executor.pooling else []),
                generates=executor.pooling is None,
                whole_prompts=executor.is_encoder,
            ),
            connector,
            structured,
            drafter=None
            if args.speculative_config is None
            else Drafter(parse_speculative_config(args.speculative_config)),
            kv_events=None if kv_events is None else kv_events.log,
        )
        core = EngineCore(
            scheduler,
            executor,
            num_clients=ctx.options.get("num_clients", 1),
            engine_index=ctx.options.get("engine_index", 0),
            data_parallel_size=args.data_parallel_size,
            recorder=recorder,
            profiler_dir=args.profiler_dir,
            world_size=args.world_size,
            lora=LoRASettings.from_engine_args(args),
            kv_events=kv_events,
        )
        core.operations.allow_weight_paths(args.allowed_weight_paths)
        standing_file = ctx.options.get("standing_file")
        standing = None
        if standing_file:
            core.standing = StandingFile(standing_file)
            standing = core.standing.read()
        # before READY: an adapter that does not load fails the start, with the ranks' word
        await core.loras.load_modules()
        if standing is not None:  # started in the place of one that died
            await restore(core, standing)
        # what it serves from now on, weights and adapters restored included: what the next
        # one in its place restores, should this one die too
        core.record_standing()
        core.ready = Ready(
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
                "max_num_seqs": args.max_num_seqs,
                # what the model pools, when it is served for embeddings or scores
                "pooling": executor.pooling,
                "tensor_parallel_size": args.tensor_parallel_size,
                "pipeline_parallel_size": args.pipeline_parallel_size,
                "worker_pids": executor.worker_pids,
                "kv_endpoints": executor.kv_endpoints,
                # what a request leaves unset falls back on (`generation_config`)
                "generation_defaults": defaults,
                # where the edges read the secret that the params they take must be
                # sealed with: the path only, never the secret
                "kv_secret_file": None if connector is None else connector.config.secret_file,
                "kv_unsealed_holds": None if connector is None else connector.config.unsealed_holds,
                # where rank 0 publishes its KV-cache events (rank r: `endpoint_of_rank`)
                "kv_events_config": None
                if kv_events is None
                else msgspec.to_builtins(kv_events.config),
                # a dead engine core is started again (`launcher.py`): how often it was
                "incarnation": ctx.options.get("incarnation", 0),
                "max_engine_restarts": args.max_engine_restarts,
            },
        )
        await ctx.ready(core.ready)
        await core.run(input_socket, output_socket)


def describe_defaults(defaults: dict[str, Any], args: EngineArgs) -> str:
    """The request defaults for the start-up log, and the flags they come from."""
    if not defaults:
        return "vLLM's neutral ones (temperature 1, top_p 1, top_k and min_p off)"
    values = ", ".join(f"{key} {value}" for key, value in defaults.items())
    source = f"--generation-config {args.generation_config}"
    if args.model is None and args.generation_config == "auto":
        source = "the default model's card, as --generation-config auto takes it"
    if args.override_generation_config:
        source += " and --override-generation-config"
    return f"{values} (from {source}; --generation-config vllm for vLLM's neutral ones)"


def _recording(ctx: ChildContext, args: EngineArgs) -> AbstractAsyncContextManager[Recorder | None]:
    """The recording of this engine core's traffic that `--record-wire` asks for, else None.
    One of several data-parallel engines records into a directory of its own under it, and so
    does one started in a dead one's place (`restart-N`)."""
    if args.record_wire is None:
        return nullcontext()
    directory = Path(args.record_wire)
    if args.data_parallel_size > 1:
        directory /= f"engine-{ctx.options.get('engine_index', 0)}"
    if ctx.options.get("incarnation"):  # started in a dead one's place: a recording of its own
        directory /= f"restart-{ctx.options['incarnation']}"
    meta = {
        "engine_args": ctx.options["engine_args"],
        "num_clients": ctx.options.get("num_clients", 1),
        "engine_index": ctx.options.get("engine_index", 0),
    }
    return open_recorder(directory, meta)
