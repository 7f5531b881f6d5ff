"""The embedding API: `open_engine` and `Engine.generate`.

```python
async with open_engine(model=None, max_num_seqs=64) as engine:
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32, temperature=0)):
        print(out.outputs[0].text)
```
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq
from tokenizers import Tokenizer

from triode.wire import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Ready,
    SamplingParams,
    Socket,
    topic_for,
)

from .config import EngineArgs
from .core_client import EngineCoreClient, EngineDeadError, RequestStream
from .detokenizer import IncrementalDetokenizer
from .intake import Intake
from .outputs import CompletionOutput, RequestOutput, token_logprobs
from .process import open_child

ENGINE_CORE = "triode.actors.engine_core:serve_engine_core"
# The largest seed `SamplingParams` takes (and the negation of the smallest).
_MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """The engine refused a request (for example, a prompt longer than the model can take)."""


class Engine:
    """A running engine. Use it from the trio run that opened it."""

    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Tokenizer,
        ready: Ready,
        addresses: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        self._addresses = dict(addresses or {})
        self.tokenizer = tokenizer
        self.intake = Intake.from_model_dir(tokenizer, Path(ready.info["model_dir"]))
        self.model_dir = Path(ready.info["model_dir"])
        self.eos_token_id: int | None = ready.info.get("eos_token_id")
        # the model's other end-of-sequence ids stop a request like stop_token_ids, as in vLLM
        self.extra_eos_token_ids: list[int] = list(ready.info.get("extra_eos_token_ids") or [])
        self.vocab_size: int = ready.info.get("vocab_size") or tokenizer.get_vocab_size()
        self.dtype: str = ready.info.get("dtype", "")
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.block_size = ready.block_size
        self.tensor_parallel_size: int = ready.info.get("tensor_parallel_size", 1)
        self.pipeline_parallel_size: int = ready.info.get("pipeline_parallel_size", 1)
        # this node's model worker processes (none when the model runs in the engine core)
        self.worker_pids: list[int] = list(ready.info.get("worker_pids") or [])

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine core is gone, or None while it runs."""
        return self._client.dead

    @property
    def pid(self) -> int:
        """The engine core's process id."""
        return self._client.pid

    @property
    def input_address(self) -> str:
        """The ZMQ address the engine core's input (PULL) socket is bound to."""
        return self._addresses["input"]

    @property
    def output_address(self) -> str:
        """The ZMQ address the engine core's output (XPUB) socket is bound to."""
        return self._addresses["output"]

    @property
    def stats(self) -> Any:
        """The scheduler's stats as of the last output received."""
        return self._client.stats

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Generate for one prompt, yielding cumulative `RequestOutput`s until it finishes.

        With `delta`, each output holds only what is new since the previous one (text, token
        ids, logprobs, prompt logprobs), which is what a stream sends on. Each yield is a
        checkpoint. Cancelling the consumer, or closing the generator early,
        aborts the request in the engine and frees its KV blocks. Raises `RequestError` if the
        engine refuses the request and `EngineDeadError` if the engine dies.

        `kv_transfer_params` go to the engine's KV connector (disaggregated prefill, `n` = 1
        only); what it hands on comes back in the last output's `kv_transfer_params`.
        """
        params = params or SamplingParams()
        if kv_transfer_params and params.n != 1:
            raise RequestError("kv_transfer_params work with n = 1 only")
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode(prompt)
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one can be generated"
            )
        request_id = request_id or uuid.uuid4().hex
        run = _Run(self, request_id, prompt, prompt_ids, params, kv_transfer_params)
        try:
            await run.start()
            while not run.finished:
                for output in await run.stream.get():
                    run.take(output)
                for child_id in run.stopped_by_string():
                    await self._client.abort_requests([child_id])
                yield run.snapshot(delta)
        finally:
            with trio.CancelScope(shield=True):
                await self._client.abort_requests(run.unfinished_ids())

    def encode(self, text: str) -> list[int]:
        return self.intake.encode_now(text)

    async def abort(self, request_ids: list[str]) -> None:
        await self._client.abort_requests(request_ids)

    async def reset_prefix_cache(self) -> bool:
        return await self._client.call_utility("reset_prefix_cache")

    async def get_stats(self) -> dict[str, Any]:
        return await self._client.call_utility("get_stats")

    async def sleep(self) -> None:
        await self._client.call_utility("sleep")

    async def wake_up(self) -> None:
        await self._client.call_utility("wake_up")

    async def is_sleeping(self) -> bool:
        return await self._client.call_utility("is_sleeping")


class _Run:
    """One `generate` call: its child requests (n of them), their detokenizers and results."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.kv_transfer_params = kv_transfer_params
        self.stream = RequestStream()
        self.params = params
        self.prompt_ids = prompt_ids
        self.output = RequestOutput(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            [
                CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
        )
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = []
        child_params = split_params(with_eos_ids(params, engine.extra_eos_token_ids))
        self.child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        )
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.child_params = child_params
        self.detokenizers = [
            IncrementalDetokenizer(engine.tokenizer, prompt_ids, p) for p in child_params
        ]
        self._stopped: list[str] = []
        self._marks = [(0, 0, 0)] * params.n  # (text, token ids, logprobs) already handed out
        self._prompt_mark = 0

    async def start(self) -> None:
        now = time.time()
        for cid, p in zip(self.child_ids, self.child_params, strict=True):
            request = EngineCoreRequest(
                cid,
                self.prompt_ids,
                p,
                self.engine.eos_token_id,
                arrival_time=now,
                kv_transfer_params=self.kv_transfer_params,
            )
            await self.engine._client.add_request(request, self.stream)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.output.outputs)

    def take(self, out: EngineCoreOutput) -> None:
        i = self.index.get(out.request_id)
        if i is None:
            return
        completion = self.output.outputs[i]
        if completion.finished:
            return  # e.g. a token that was in flight when a stop string ended it
        if out.finish_reason is FinishReason.ERROR:
            raise RequestError(str(out.stop_reason or "the engine failed the request"))
        if out.num_cached_tokens:
            self.output.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.output.kv_transfer_params = out.kv_transfer_params
        if out.new_prompt_logprobs is not None and self.output.prompt_logprobs is not None:
            self.output.prompt_logprobs.extend(token_logprobs(out.new_prompt_logprobs))
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and completion.logprobs is not None:
            completion.logprobs.extend(token_logprobs(out.new_logprobs))
        on_stop_token = out.finish_reason is FinishReason.STOP and not isinstance(
            out.stop_reason, str
        )
        detok = self.detokenizers[i]
        stop_string = detok.update(out.new_token_ids, stop_terminated=on_stop_token)
        if stop_string is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop_string
            self._stopped.append(out.request_id)
        elif out.finish_reason is not None:
            completion.finish_reason = str(out.finish_reason)
            completion.stop_reason = out.stop_reason
        completion.text += detok.delta(completion.finished)

    def stopped_by_string(self) -> list[str]:
        stopped, self._stopped = self._stopped, []
        return stopped

    def snapshot(self, delta: bool) -> RequestOutput:
        """The output so far, or with `delta` what was added since the last snapshot."""
        out = self.output
        out.finished = self.finished
        marks = self._marks if delta else [(0, 0, 0)] * len(out.outputs)
        completions = [
            CompletionOutput(
                c.index,
                c.text[text:],
                c.token_ids[tokens:],
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else c.logprobs[logprobs:],
            )
            for c, (text, tokens, logprobs) in zip(out.outputs, marks, strict=True)
        ]
        prompt_logprobs = out.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[self._prompt_mark if delta else 0 :]
        if delta:
            self._marks = [
                (len(c.text), len(c.token_ids), len(c.logprobs or ())) for c in out.outputs
            ]
            self._prompt_mark = len(out.prompt_logprobs or ())
        return RequestOutput(
            out.request_id,
            out.prompt,
            out.prompt_token_ids,
            completions,
            out.finished,
            out.num_cached_tokens,
            prompt_logprobs,
            out.kv_transfer_params,
        )

    def unfinished_ids(self) -> list[str]:
        return [
            cid
            for cid, c in zip(self.child_ids, self.output.outputs, strict=True)
            if not c.finished
        ]


def with_eos_ids(params: SamplingParams, eos_ids: list[int]) -> SamplingParams:
    """`params` stopping also on the model's other end-of-sequence ids, unless it ignores EOS."""
    extra = [t for t in eos_ids if t not in params.stop_token_ids]
    if params.ignore_eos or not extra:
        return params
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])


def split_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each of a request's `n` sequences: `n=1`, and seeds `seed + i`.

    A seed near the top of the range wraps around to its bottom rather than overflowing it, so
    every sequence gets a distinct seed that the engine core accepts.
    """
    if params.seed is None:
        return [msgspec.structs.replace(params, n=1) for _ in range(params.n)]
    span = 2 * _MAX_SEED + 1
    return [
        msgspec.structs.replace(params, n=1, seed=(params.seed + i + _MAX_SEED) % span - _MAX_SEED)
        for i in range(params.n)
    ]


def _openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """OpenMP threads that finish a parallel region spin briefly before they sleep: long
    enough to catch the next operator of the same forward pass (a few microseconds away),
    short enough not to steal the cores the edge and other processes need between steps.
    Measured on 2 cores, bfloat16, SmolLM2-135M: 24 tok/s for one stream and 398 tok/s for 64,
    against 17 and 278 when idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE). A policy the
    user set wins."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": "10000"}


def _malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """glibc serves allocations above its mmap threshold with fresh pages and hands freed heap
    back to the system: every step's activations and logits (12 MB of float32 for 64 rows of a
    49k vocabulary) then fault their pages in anew. Keeping blocks up to 256 MiB on the heap,
    and up to 256 MiB of free heap, measured 58.0 ms against 65.9 ms per 64-sequence decode
    step of SmolLM2 on 2 cores. Settings the user made win."""
    if any(name in environ for name in _MALLOC_SETTINGS) or "GLIBC_TUNABLES" in environ:
        return {}
    return dict.fromkeys(_MALLOC_SETTINGS, str(256 << 20))


_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def ready_timeout() -> float:
    """How long a process that loads the model may take to say READY (TRIODE_ENGINE_READY_TIMEOUT
    seconds, 900 by default: a first start converts the GGUF file)."""
    return float(os.environ.get("TRIODE_ENGINE_READY_TIMEOUT", 900))


def model_process_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a process that runs the model (the engine core, a worker) adds to `environ`."""
    return _openmp_env(environ) | _malloc_env(environ)


@asynccontextmanager
async def open_engine(model: str | None = None, **engine_args: Any) -> AsyncIterator[Engine]:
    """Start an engine core process for `model` and yield an `Engine` once it is ready.

    `model` is a Hugging Face directory, a `.gguf` file, or None for the default model;
    `engine_args` are `EngineArgs` fields (the CLI flags' names). Leaving the block stops the
    engine process (graceful message, then signals). Raises `TypeError`/`ValueError` for bad
    arguments and `RemoteError` (in an exception group) if the engine fails to start.
    """
    args = EngineArgs(model=model, **engine_args)
    tmpdir = tempfile.mkdtemp(prefix="triode-engine-")
    addresses = {"input": f"ipc://{tmpdir}/input", "output": f"ipc://{tmpdir}/output"}
    zctx = zmq.Context()
    input_socket = Socket.open(zctx, zmq.PUSH, connect=addresses["input"])
    output_socket = Socket.open(zctx, zmq.SUB, connect=addresses["output"], subscribe=topic_for(0))
    try:
        async with open_child(
            ENGINE_CORE,
            name="engine-core",
            addresses=addresses,
            options={"engine_args": msgspec.to_builtins(args), "num_clients": 1},
            raise_on_death=False,
            env=model_process_env(os.environ),
            ready_timeout=ready_timeout(),
        ) as child:
            assert child.ready is not None
            tokenizer = await trio.to_thread.run_sync(
                Tokenizer.from_file, str(Path(child.ready.info["model_dir"]) / "tokenizer.json")
            )
            client = EngineCoreClient(input_socket, output_socket, child)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run)
                yield Engine(client, tokenizer, child.ready, addresses)
                nursery.cancel_scope.cancel()
    finally:
        input_socket.close()
        output_socket.close()
        zctx.term()
        shutil.rmtree(tmpdir, ignore_errors=True)


__all__ = ["Engine", "EngineDeadError", "RequestError", "open_engine"]
