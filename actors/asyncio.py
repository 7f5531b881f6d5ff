"""The embedding API for asyncio programs: trio runs as a guest on the running asyncio loop.

```python
import asyncio

from triode.actors import SamplingParams
from triode.actors.asyncio import open_engine

async def main() -> None:
    async with open_engine("tiny-random") as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32, temperature=0)):
            print(out.outputs[0].text)

asyncio.run(main())
```

`Bridge` is trio's guest mode (`trio.lowlevel.start_guest_run`) on the asyncio loop: trio's
tasks run in the loop's thread, between its callbacks, so the engine client is the trio one,
unchanged. A loop has at most one guest run (trio keeps one run per thread); every
`open_bridge` block of a loop shares it, and the last one to leave ends it.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from typing import Any, Generic, TypeVar

import outcome
import trio

from triode.wire import SamplingParams

from .engine import Engine
from .engine import open_engine as open_trio_engine
from .outputs import RequestOutput

T = TypeVar("T")

# outputs a generate call's trio task may run ahead of its asyncio consumer
OUTPUTS_IN_FLIGHT = 2

_bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Bridge] = weakref.WeakKeyDictionary()


class TrioCall(Generic[T]):
    """A trio task started from asyncio by `Bridge.start`."""

    def __init__(
        self, bridge: Bridge, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]
    ) -> None:
        self._bridge = bridge
        self._scope = trio.CancelScope()
        self._done: asyncio.Future[outcome.Outcome[T]] = bridge.loop.create_future()
        bridge.soon(self._spawn, fn, args)

    def _spawn(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        try:
            trio.lowlevel.spawn_system_task(self._run, fn, args, name=fn)
        except RuntimeError as e:  # the guest run is shutting down
            self._settle(outcome.Error(e))

    async def _run(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        with self._scope:
            # everything, trio.Cancelled included, goes to the asyncio side as the outcome
            self._settle(await outcome.acapture(fn, *args))

    def _settle(self, result: outcome.Outcome[T]) -> None:
        if not self._done.done():
            self._done.set_result(result)

    def cancel(self) -> None:
        """Cancel the trio task (it sees `trio.Cancelled`); returns at once."""
        if not self._done.done():
            try:
                self._bridge.soon(self._scope.cancel)
            except RuntimeError:
                pass  # the run is over, and the task with it

    async def wait(self) -> outcome.Outcome[T]:
        """The task's outcome once it ended. Waits through asyncio cancellation, which it
        raises afterwards: the trio task always finishes first."""
        return await _wait_through_cancel(self._done)

    def unwrap(self, result: outcome.Outcome[T]) -> T:
        """`result`'s value, or its exception raised. A task ended by `cancel` raises
        `asyncio.CancelledError`; one ended because the guest run stopped, `RuntimeError`."""
        if isinstance(result, outcome.Error) and _only_cancelled(result.error):
            if self._scope.cancel_called:
                raise asyncio.CancelledError
            raise RuntimeError("the trio run stopped before the call finished")
        return result.unwrap()


class Bridge:
    """The trio guest run on one asyncio loop; get it with `open_bridge`.

    From asyncio: `run`, `start` and `enter` run trio code. From trio: `run_asyncio` runs
    asyncio code. Cancellation crosses both ways, and each side waits for the other to finish.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._users = 0
        self._stopping = False
        self._stop = trio.Event()
        self._finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        trio.lowlevel.start_guest_run(
            self._main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=self._done,
            # signals stay the host's: asyncio's add_signal_handler owns the wakeup fd, and
            # trio taking it would leave asyncio's handlers deaf
            host_uses_signal_set_wakeup_fd=True,
        )
        self._token = trio.lowlevel.current_trio_token()

    async def _main(self) -> None:
        await self._stop.wait()

    def _done(self, result: outcome.Outcome[None]) -> None:
        if _bridges.get(self.loop) is self:
            del _bridges[self.loop]  # a later `open_bridge` starts a new run
        self._finished.set_result(result)

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Call the synchronous `fn(*args)` in trio's context soon (thread-safe). Raises
        `RuntimeError` once the guest run has ended."""
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise RuntimeError("the trio run has stopped") from None

    def start(self, fn: Callable[..., Awaitable[T]], *args: Any) -> TrioCall[T]:
        """Start `await fn(*args)` as a trio task; returns its handle at once."""
        return TrioCall(self, fn, args)

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` in trio, from asyncio: its value, or its exception re-raised.

        Cancelling the awaiting asyncio task cancels the trio task and waits for it to end
        (its shielded cleanup runs) before `CancelledError` propagates. Raises `RuntimeError`
        if the guest run stops first."""
        call = self.start(fn, *args)
        try:
            result = await asyncio.shield(call._done)
        except asyncio.CancelledError:
            call.cancel()
            await call.wait()
            raise
        return call.unwrap(result)

    @asynccontextmanager
    async def enter(
        self, open_cm: Callable[[], AbstractAsyncContextManager[T]]
    ) -> AsyncIterator[T]:
        """`async with open_cm() as value` held by a trio task for the asyncio block, which
        gets `value`. Errors entering or leaving it are raised here. Leaving the block exits it
        normally (no exception is thrown in) and waits for that, through cancellation."""
        entered: asyncio.Future[T] = self.loop.create_future()
        leave = trio.Event()

        async def hold() -> None:
            async with open_cm() as value:
                entered.set_result(value)
                await leave.wait()

        call = self.start(hold)
        try:
            await asyncio.wait([entered, call._done], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            await call.wait()
            raise
        if not entered.done():
            call.unwrap(call._done.result())
            raise RuntimeError(f"{open_cm!r} ended without entering")
        try:
            yield entered.result()
        finally:
            self.soon(leave.set)
            result = await call.wait()
        call.unwrap(result)

    async def run_asyncio(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """`await fn(*args)` as an asyncio task, from trio: its value, or its exception.

        A checkpoint. Cancelling the trio caller cancels the asyncio task and waits (shielded)
        for it to end."""
        task = self.loop.create_task(fn(*args))
        ended = trio.Event()
        task.add_done_callback(lambda _: self.soon(ended.set))
        try:
            await ended.wait()
        finally:
            if not task.done():
                task.cancel()
                with trio.CancelScope(shield=True):
                    await ended.wait()
        return task.result()

    async def _close(self) -> None:
        self._stopping = True
        if not self._finished.done():
            self.soon(self._stop.set)
        result = await _wait_through_cancel(self._finished)
        result.unwrap()


@asynccontextmanager
async def open_bridge() -> AsyncIterator[Bridge]:
    """The running loop's trio guest run, started if it has none; the last block to leave
    stops it (waiting for it through cancellation). Raises `RuntimeError` in a thread that
    already runs trio."""
    loop = asyncio.get_running_loop()
    while (bridge := _bridges.get(loop)) is not None and bridge._stopping:
        await asyncio.shield(bridge._finished)  # a run on its way out: start after it
    if bridge is None:
        bridge = _bridges[loop] = Bridge(loop)
    bridge._users += 1
    try:
        yield bridge
    finally:
        bridge._users -= 1
        if not bridge._users:
            await bridge._close()


# Plain attributes of `Engine` that `AsyncioEngine` hands through as they are.
_ATTRIBUTES = frozenset(
    {
        "tokenizer", "model_dir", "eos_token_id", "extra_eos_token_ids", "vocab_size", "dtype",
        "max_model_len", "num_kv_blocks", "block_size", "tensor_parallel_size",
        "pipeline_parallel_size", "data_parallel_size", "worker_pids", "dead", "engines_alive",
        "pid", "pids", "endpoints", "input_address", "output_address", "stats", "restarts",
    }
)  # fmt: skip


class AsyncioEngine:
    """An `Engine` for asyncio code, on the loop that opened it: the same methods, as asyncio
    coroutines, and `Engine`'s plain attributes (`tokenizer`, `max_model_len`, `pid`, ...).

    Each coroutine is the `Engine` method run by `Bridge.run`: it raises what the method
    raises, and cancelling it cancels the method in trio and waits for it to end. `engine` and
    `bridge` are the trio engine and its guest run, for trio code of one's own."""

    def __init__(self, engine: Engine, bridge: Bridge) -> None:
        self.engine = engine
        self.bridge = bridge

    def __getattr__(self, name: str) -> Any:
        if name in _ATTRIBUTES:
            return getattr(self.engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    async def generate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        delta: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """`Engine.generate` as an asyncio async iterator: the same outputs, in order. Every
        argument, and any other keyword option `Engine.generate` takes, is passed through.

        A trio task iterates `Engine.generate` and runs at most `OUTPUTS_IN_FLIGHT` outputs
        ahead. Cancelling the consuming task, or closing the iterator early, cancels that trio
        task, which aborts the request and frees its KV blocks, and waits for it. Raises what
        `Engine.generate` raises (`RequestError`, `EngineDeadError`)."""
        send, receive = trio.open_memory_channel[RequestOutput](OUTPUTS_IN_FLIGHT)
        sent = asyncio.Event()
        outputs = functools.partial(
            self.engine.generate,
            prompt,
            params,
            request_id,
            delta=delta,
            kv_transfer_params=kv_transfer_params,
            **options,
        )
        call = self.bridge.start(_produce, outputs, send, sent)
        ended = False
        try:
            while True:
                # guest mode lets the host run trio's synchronous operations directly, and
                # trio's tasks set asyncio's events: no output costs a trip through the run
                try:
                    out = receive.receive_nowait()
                except trio.WouldBlock:
                    sent.clear()
                    await sent.wait()
                    continue
                except trio.EndOfChannel:
                    break
                yield out
            ended = True
        finally:
            if not ended:
                call.cancel()
            result = await call.wait()
            receive.close()
        call.unwrap(result)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    async def abort(self, request_ids: list[str]) -> None:
        """`Engine.abort`: abort in every engine core. Bounded in time."""
        await self.bridge.run(self.engine.abort, request_ids)

    async def reset_prefix_cache(self) -> bool:
        return await self.bridge.run(self.engine.admin.reset_prefix_cache)

    async def get_stats(self) -> dict[str, Any]:
        """`Engine.get_stats`: the engine cores' stats, summed."""
        return await self.bridge.run(self.engine.get_stats)

    async def sleep(self, level: int = 1, tags: list[str] | None = None) -> dict[str, Any]:
        """`EngineAdmin.sleep`."""
        return await self.bridge.run(self.engine.admin.sleep, level, tags)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """`EngineAdmin.wake_up`."""
        return await self.bridge.run(self.engine.admin.wake_up, tags)

    async def is_sleeping(self) -> bool:
        return await self.bridge.run(self.engine.admin.is_sleeping)

    async def list_loras(self) -> list[dict[str, Any]]:
        """`Engine.list_loras`."""
        return await self.bridge.run(self.engine.list_loras)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> dict[str, Any]:
        """`EngineAdmin.load_lora_adapter`."""
        return await self.bridge.run(
            self.engine.admin.load_lora_adapter, lora_name, lora_path, load_inplace
        )

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """`EngineAdmin.unload_lora_adapter`."""
        return await self.bridge.run(self.engine.admin.unload_lora_adapter, lora_name)


async def _produce(
    generate: Callable[[], AsyncGenerator[RequestOutput, None]],
    send: trio.MemorySendChannel[RequestOutput],
    sent: asyncio.Event,
) -> None:
    """Send `generate()`'s outputs, setting `sent` after each and once the channel closed."""
    try:
        # aclosing: a cancelled send must close the generator now, so its shielded abort runs
        outputs = generate()
        async with send, aclosing(outputs):
            async for out in outputs:
                await send.send(out)
                sent.set()
    finally:
        sent.set()


@asynccontextmanager
async def open_engine(model: str | None = None, **engine_args: Any) -> AsyncIterator[AsyncioEngine]:
    """`triode.actors.open_engine` for asyncio: start the engine and yield an `AsyncioEngine`
    once it is ready; leaving the block stops the engine processes and, with the last user of
    the loop's trio guest run, the run. Raises what `open_engine` raises (`TypeError` or
    `ValueError` for bad arguments, `RemoteError` in a group if an engine fails to start).
    Cancelling the start stops what was started."""
    async with (
        open_bridge() as bridge,
        bridge.enter(functools.partial(open_trio_engine, model, **engine_args)) as engine,
    ):
        yield AsyncioEngine(engine, bridge)


async def _wait_through_cancel(future: asyncio.Future[T]) -> T:
    """`future`'s result, waited for even when the task is cancelled meanwhile; the
    cancellation is raised once it is done."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


def _only_cancelled(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return error.split(trio.Cancelled)[1] is None
    return isinstance(error, trio.Cancelled)


__all__ = ["AsyncioEngine", "Bridge", "TrioCall", "open_bridge", "open_engine"]
