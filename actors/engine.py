"""The embedding API: `open_engine` and `Engine.generate`.

```python
async with open_engine(model=None, max_num_seqs=64) as engine:
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32, temperature=0)):
        print(out.outputs[0].text)
```
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import zmq
from tokenizers import Tokenizer

from triode.wire import (
    Ready,
    SamplingParams,
    SchedulerStats,
    Socket,
    topic_for,
)
from triode.wire.kv_seal import kv_salt, read_secret
from triode.wire.messages import MAX_WIRE_CACHE_SALT
from triode.wire.tensor_ipc import SharedTensor, TensorHandle

from .admin import EngineAdmin
from .config import EngineArgs
from .core.kv_events import kv_event_sources
from .core_client import EngineCoreClient, EngineDeadError
from .errors import RequestError, RequestRefused
from .generate_call import GenerateCall
from .intake import Intake
from .kv_params import seal_error, transfer_params_error
from .launcher import EngineCoreEndpoint, open_engine_cores
from .lora_modules import lora_name_problem
from .outputs import RequestOutput
from .peer import Peer
from .pooling import PoolingAPI
from .process import Child
from .prompt_embeds import check_prompt_embeds, describe_prompt_embeds, share_prompt_embeds

# how long a client waits for its first round trip to each engine core
CONNECT_TIMEOUT = 30.0


class Engine(PoolingAPI):
    """A running engine: one engine core, or several (data parallel) that requests are
    balanced over. Use it from the trio run that opened it. A model served for embeddings or
    scores takes `embed`, `classify` and `score` calls (`PoolingAPI`) in place of `generate`."""

    def __init__(
        self,
        clients: list[EngineCoreClient],
        tokenizer: Tokenizer,
        ready: Ready,
        endpoints: list[EngineCoreEndpoint] | None = None,
    ) -> None:
        self._clients = clients
        self._endpoints = list(endpoints or [])
        self._turn = 0
        self.tokenizer = tokenizer
        self.intake = Intake.from_model_dir(tokenizer, Path(ready.info["model_dir"]))
        self.model_dir = Path(ready.info["model_dir"])
        self.eos_token_id: int | None = ready.info.get("eos_token_id")
        # the model's other end-of-sequence ids stop a request like stop_token_ids, as in vLLM
        self.extra_eos_token_ids: list[int] = list(ready.info.get("extra_eos_token_ids") or [])
        self.vocab_size: int = ready.info.get("vocab_size") or tokenizer.get_vocab_size()
        # what a prompt's embeddings must have per position (0: unknown, any)
        self.hidden_size: int = ready.info.get("hidden_size") or 0
        self.dtype: str = ready.info.get("dtype", "")
        # the model's request defaults (temperature, top_p, top_k, min_p, repetition_penalty,
        # max_tokens) for what a request leaves unset; empty: vLLM's neutral ones
        self.generation_defaults: dict[str, Any] = dict(ready.info.get("generation_defaults") or {})
        self.max_model_len = ready.max_model_len
        self.max_num_seqs: int = ready.info.get("max_num_seqs") or 256
        # what the model pools (`pooling_spec.PoolingSpec`): None when it generates text
        self.pooling: dict[str, Any] | None = ready.info.get("pooling")
        self.num_kv_blocks = ready.num_kv_blocks  # each engine core's
        self.block_size = ready.block_size
        self.tensor_parallel_size: int = ready.info.get("tensor_parallel_size", 1)
        self.pipeline_parallel_size: int = ready.info.get("pipeline_parallel_size", 1)
        # the KV connector's deployment secret: kv_transfer_params must carry its seals
        secret_file = ready.info.get("kv_secret_file")
        self.kv_secret: bytes | None = read_secret(secret_file) if secret_file else None
        # a prefill seals an authenticated caller's unsealed do_remote_decode itself
        # ("authenticated"), or takes only its proxy's ("never")
        self.kv_unsealed_holds: str = ready.info.get("kv_unsealed_holds") or "never"
        self.data_parallel_size = len(clients)
        # where each engine core publishes its KV-cache events, by data-parallel rank
        self.kv_event_sources = kv_event_sources(
            ready.info.get("kv_events_config"), self.data_parallel_size
        )
        # sleep, wake, pause, profiling, new weights and LoRA adapters, on every engine core
        self.admin = EngineAdmin(self._call_all)

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine is gone (every engine core of it), or None while one runs."""
        if any(c.dead is None for c in self._clients):
            return None
        return self._clients[0].dead

    @property
    def worker_pids(self) -> list[int]:
        """This node's model worker processes (none when the model runs in the engine core),
        as the engine cores running now said."""
        return [pid for c in self._clients for pid in c.ready.info.get("worker_pids") or []]

    @property
    def restarts(self) -> int:
        """How often engine cores were started again in the place of dead ones."""
        return sum(c.incarnation for c in self._clients)

    @property
    def engines_alive(self) -> int:
        """How many of the engine cores still run."""
        return sum(c.dead is None for c in self._clients)

    @property
    def pid(self) -> int:
        """The (first) engine core's process id."""
        return self._clients[0].pid

    @property
    def pids(self) -> list[int]:
        """Every engine core's process id, by engine index."""
        return [c.pid for c in self._clients]

    @property
    def endpoints(self) -> list[EngineCoreEndpoint]:
        """How to reach each engine core (what an API server process connects to)."""
        return list(self._endpoints)

    @property
    def input_address(self) -> str:
        """The ZMQ address the (first) engine core's input (PULL) socket is bound to."""
        return self._endpoints[0].input

    @property
    def output_address(self) -> str:
        """The ZMQ address the (first) engine core's output (XPUB) socket is bound to."""
        return self._endpoints[0].output

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's stats as of the last output received, summed over engine cores."""
        return sum_stats([c.stats for c in self._clients])

    def _pick(self, rank: int | None = None) -> EngineCoreClient:
        """Engine core `rank` where one is asked for and it lives; else the live engine core
        with the shortest queue, ties going round in turn."""
        if rank is not None:
            if not 0 <= rank < len(self._clients):
                raise RequestError(
                    f"data_parallel_rank must be 0 to {len(self._clients) - 1}, not {rank}"
                )
            if self._clients[rank].dead is None:
                return self._clients[rank]
        live = [c for c in self._clients if c.dead is None]
        if not live:
            raise self._clients[0].dead or EngineDeadError("no engine core is running")
        self._turn += 1
        start = self._turn % len(live)
        order = live[start:] + live[:start]
        return min(order, key=lambda c: c.load)

    async def generate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_embeds: Any = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding cumulative `RequestOutput`s until it finishes.

        With `delta`, each output holds only what is new since the previous one (text, token
        ids, logprobs, prompt logprobs), which is what a stream sends on. Each yield is a
        checkpoint. Cancelling the consumer, or closing the generator early,
        aborts the request in the engine and frees its KV blocks. Raises `RequestError` if the
        engine refuses the request, `RequestRefused` if it cannot take it for now (its queue is
        full), and `EngineDeadError` if the engine dies.

        `kv_transfer_params` go to the engine's KV connector (disaggregated prefill, `n` = 1
        only); what it hands on comes back in the last output's `kv_transfer_params`.

        `prompt_embeds`, with `prompt` None, gives the prompt as embeddings [positions,
        `hidden_size`]: a numpy array (float32, float16), a CPU torch tensor (float32,
        bfloat16, float16), or a `TensorHandle` already shared, which the engine takes over.
        They reach the engine core through shared memory, unlinked when the request ends,
        however it ends. Not with prompt logprobs or `kv_transfer_params`.

        `cache_salt` enters the hash of the prompt's first KV block: the request shares cached
        prefix blocks only with requests of the same salt (none: with unsalted ones).

        `lora_name` runs the request with the LoRA adapter loaded under that name
        (`list_loras`; None: the base model); one the engine core does not have is refused
        (`RequestError`). Its cached prefix blocks are shared only with requests of the same
        adapter's content, and `kv_transfer_params` made for it only serve it.

        `data_parallel_rank` runs it on that engine core (vLLM's: a router that knows where its
        prefix is cached asks for it); one out of range is refused (`RequestError`), a dead one
        leaves the choice to the queues, as when none is asked for.
        """
        params = params or SamplingParams()
        try:
            if cache_salt is not None and not 0 < len(cache_salt) <= MAX_WIRE_CACHE_SALT:
                raise RequestError(
                    f"cache_salt must be a non-empty string of at most {MAX_WIRE_CACHE_SALT} "
                    "characters"
                )
            if lora_name is not None and (problem := lora_name_problem(lora_name)) is not None:
                raise RequestError(f"lora_name: {problem}")
            prompt_ids = self._prompt_ids(prompt, prompt_embeds, params, kv_transfer_params)
            self._check_transfer_params(
                kv_transfer_params, prompt_ids, kv_salt(cache_salt, lora_name)
            )
            client = self._pick(data_parallel_rank)
            shared: list[tuple[TensorHandle, SharedTensor]] = []
            if prompt_embeds is not None:
                shared = share_prompt_embeds(prompt_embeds, params.n)
        except BaseException as e:
            if isinstance(prompt_embeds, TensorHandle):  # taken over: refused, it goes
                SharedTensor(prompt_embeds).unlink()
            if isinstance(e, ValueError | OSError) and not isinstance(e, RequestError):
                raise RequestError(str(e)) from None
            raise
        request_id = request_id or uuid.uuid4().hex
        handles = [handle for handle, _ in shared]
        run = GenerateCall(
            self, request_id, prompt, prompt_ids, params, kv_transfer_params, handles, cache_salt,
            lora_name,
        )  # fmt: skip
        try:
            await run.start(client)
            while not run.finished:
                for output in await run.stream.get():
                    run.take(output)
                for child_id in run.stopped_by_string():
                    await client.abort_requests([child_id])
                yield run.snapshot(delta)
        finally:
            for _, owner in shared:
                owner.unlink()
            with trio.CancelScope(shield=True):
                await client.abort_requests(run.unfinished_ids())

    def _prompt_ids(
        self,
        prompt: str | list[int] | None,
        prompt_embeds: Any,
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
    ) -> list[int]:
        """The prompt's token ids (placeholders for embeddings); RequestError for a prompt
        the engine cannot take."""
        if kv_transfer_params and params.n != 1:
            raise RequestError("kv_transfer_params work with n = 1 only")
        if prompt_embeds is None:
            if prompt is None:
                raise RequestError("give a prompt or prompt_embeds")
            prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt)
        else:
            if prompt is not None:
                raise RequestError("give a prompt or prompt_embeds, not both")
            if params.prompt_logprobs is not None or kv_transfer_params:
                raise RequestError(
                    "prompt_embeds: prompt_logprobs and kv_transfer_params do not go with them"
                )
            dtype, shape = describe_prompt_embeds(prompt_embeds)
            check_prompt_embeds(dtype, shape, self.hidden_size)
            prompt_ids = [0] * shape[0]  # placeholders, as in vLLM
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one can be generated"
            )
        return prompt_ids

    def _check_transfer_params(
        self, params: dict[str, Any] | None, prompt_ids: list[int], salt: str | bytes | None
    ) -> None:
        """RequestError unless `params` are well formed and, where they ask this deployment
        to act (load a prompt's KV, hold one), sealed by it, for this very prompt (its cache
        salt and LoRA adapter bound in `salt`, `kv_seal.kv_salt`): checked before the request
        reaches the engine core, which checks again."""
        if not params:
            return
        if self.kv_secret is None:  # no KV connector: the params ride along unused
            problem = transfer_params_error(params)
        else:
            problem = seal_error(self.kv_secret, params, prompt_ids, salt)
        if problem is not None:
            raise RequestError(problem)

    def encode(self, text: str) -> list[int]:
        return self.intake.encode_now(text)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort in every engine core (idempotent there). Bounded in time."""
        for client in self._clients:
            await client.abort_requests(request_ids)

    async def list_loras(self) -> list[dict[str, Any]]:
        """The LoRA adapters served, in the order they were loaded: each a dict of `name`,
        `path`, `lora_id`, `digest` (SHA-256 of its files), `rank` and `base_model_name`.
        Every engine core serves the same ones; the first live one answers. Raises
        `EngineDeadError` when none is left."""
        live = [c for c in self._clients if c.dead is None]
        if not live:
            raise self._clients[0].dead or EngineDeadError("no engine core is running")
        return await live[0].call_utility("list_loras")

    async def get_stats(self) -> dict[str, Any]:
        """The engine cores' stats, summed (`kv_cache_usage` over all their blocks), with
        each live one's own under `engines`."""
        per_engine = await self._call_all("get_stats")
        return sum_stat_dicts(per_engine) | {"engines": per_engine}

    async def seconds_stalled(self) -> float:
        """The longest any live engine core has made no step while it had requests to work
        on (0 when each is idle, stepping or asleep). Raises `EngineDeadError` when none is
        left; cancelling it leaves nothing behind."""
        return max(await self._call_all("seconds_stalled"))

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """`method`'s results from every live engine core, in engine order. Raises
        `EngineDeadError` when none is left, and the first failure that is not a death."""
        live = [c for c in self._clients if c.dead is None]
        if not live:
            raise self._clients[0].dead or EngineDeadError("no engine core is running")
        if len(live) == 1:
            return [await live[0].call_utility(method, *args)]
        outcomes: list[Any] = [None] * len(live)

        async def call(i: int, client: EngineCoreClient) -> None:
            try:
                outcomes[i] = await client.call_utility(method, *args)
            except Exception as e:  # an engine that died meanwhile, or the method's failure
                outcomes[i] = e

        async with trio.open_nursery() as nursery:
            for i, client in enumerate(live):
                nursery.start_soon(call, i, client)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        results = [o for o in outcomes if not isinstance(o, Exception)]
        if not results or any(not isinstance(f, EngineDeadError) for f in failures):
            raise failures[0]
        return results


@asynccontextmanager
async def open_engine(model: str | None = None, **engine_args: Any) -> AsyncIterator[Engine]:
    """Start the engine core process(es) for `model` and yield an `Engine` once ready.

    `model` is a Hugging Face directory, a `.gguf` file, or None for the default model;
    `engine_args` are `EngineArgs` fields (the CLI flags' names); `data_parallel_size` starts
    that many engine cores, each with its own KV cache, and `generate` balances requests over
    them. Leaving the block stops the engine processes (graceful message, then signals).
    Raises `TypeError`/`ValueError` for bad arguments and `RemoteError` (in an exception group)
    if an engine fails to start.
    """
    args = EngineArgs(model=model, **engine_args)
    async with open_engine_cores(args) as cores:
        async with connect_engine(
            [endpoint for endpoint, _ in cores], processes=[child for _, child in cores]
        ) as engine:
            yield engine


@asynccontextmanager
async def connect_engine(
    endpoints: list[EngineCoreEndpoint],
    *,
    client_index: int = 0,
    processes: list[Child | Peer] | None = None,
) -> AsyncIterator[Engine]:
    """An `Engine` over engine cores that are already running, as client `client_index` of
    each (an API server process passes its own index). `processes` are the cores as children
    of this process; without them each core is watched as a `Peer` by its pid. Returns once
    every core has answered a round trip, so that this client's subscription is confirmed."""
    processes = processes or [Peer(f"engine-core-{e.index}", e.pid) for e in endpoints]
    first = endpoints[0].ready
    tokenizer = await trio.to_thread.run_sync(
        Tokenizer.from_file, str(Path(first.info["model_dir"]) / "tokenizer.json")
    )
    # an encoder's tokenizer.json may pad and cut every encoding (all-MiniLM-L6-v2's: to 128):
    # a prompt is its own tokens, and the engine checks and cuts lengths itself
    tokenizer.no_padding()
    tokenizer.no_truncation()
    zctx = zmq.Context()
    sockets: list[Socket] = []

    def open_sockets(endpoint: EngineCoreEndpoint) -> tuple[Socket, Socket]:
        input_socket = Socket.open(zctx, zmq.PUSH, connect=endpoint.input)
        sockets.append(input_socket)
        output_socket = Socket.open(
            zctx, zmq.SUB, connect=endpoint.output, subscribe=topic_for(client_index)
        )
        sockets.append(output_socket)
        return input_socket, output_socket

    try:
        clients = []
        for endpoint, process in zip(endpoints, processes, strict=True):
            # an engine core that dies is started again at its addresses (`launcher.py`)
            restarts = endpoint.ready.info.get("max_engine_restarts")
            clients.append(
                EngineCoreClient(
                    *open_sockets(endpoint),
                    process,
                    client_index=client_index,
                    engine_index=endpoint.index,
                    ready=endpoint.ready,
                    reopen=functools.partial(open_sockets, endpoint) if restarts else None,
                )
            )
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(client.run)
            engine = Engine(clients, tokenizer, first, endpoints)
            with trio.fail_after(CONNECT_TIMEOUT):
                await engine._call_all("is_sleeping")
            yield engine
            nursery.cancel_scope.cancel()
    finally:
        for socket in sockets:
            socket.close()
        zctx.term()


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' stats as one: counts summed, KV usage over all their blocks."""
    if len(stats) == 1:
        return stats[0]
    fields = SchedulerStats.__struct_fields__
    total = sum_stat_dicts([{f: getattr(s, f) for f in fields} for s in stats])
    return SchedulerStats(**{f: total[f] for f in fields})


def sum_stat_dicts(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key, lists of numbers position by position, except
    `kv_cache_usage`: the used share of all blocks."""
    if len(stats) == 1:
        return dict(stats[0])
    total: dict[str, Any] = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, list):
                summed = total.setdefault(key, [])
                summed += [0] * (len(value) - len(summed))
                for i, x in enumerate(value):
                    summed[i] += x
    blocks = sum(s.get("num_total_blocks", 0) for s in stats)
    if blocks:
        used = sum(s.get("kv_cache_usage", 0.0) * s.get("num_total_blocks", 0) for s in stats)
        total["kv_cache_usage"] = used / blocks
    return total


__all__ = [
    "Engine",
    "EngineDeadError",
    "RequestError",
    "RequestRefused",
    "connect_engine",
    "open_engine",
]
