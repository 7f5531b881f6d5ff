"""The multiprocess executor from the engine core's side: real worker processes on gloo.

This test process plays the engine core: it opens the executor, broadcasts steps and reads the
driver's answers, as `engine_core` does.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest
import trio
from processes import alive, listening_sockets

from triode.actors.config import EngineArgs
from triode.actors.core.multiproc import WorkerDied, open_multiproc_executor
from triode.actors.model_env import model_process_env
from triode.wire import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    WorkerMessageType,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 100, 3, 77]


@pytest.fixture(autouse=True)
def engine_core_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process plays the engine core, in an engine core's environment: its workers are
    then forked by the worker's fork server, as a real engine core's are, not executed."""
    for name, value in model_process_env(os.environ).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from triode.gpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("multiproc") / "tiny", num_layers=4)


def _args(model: Path, **extra: object) -> EngineArgs:
    return EngineArgs(
        model=str(model),
        dtype="float32",
        kv_cache_memory="8MiB",
        max_model_len=128,
        **extra,  # type: ignore[arg-type]
    )


def _prefill(step: int = 0) -> SchedulerOutput:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    request = ScheduledRequest("r", PROMPT, 0, [0], new=NewRequestData(PROMPT, params))
    return SchedulerOutput(step=step, requests=[request])


async def _greedy(executor: object, steps: int) -> list[int]:
    """Prefill, then `steps` decodes of one request; the tokens the driver sampled."""
    out = await executor.execute(_prefill())  # type: ignore[attr-defined]
    tokens = [out.results[0].token_id]
    for step in range(1, steps + 1):
        position = len(PROMPT) + len(tokens) - 1
        request = ScheduledRequest("r", [tokens[-1]], position, [0, 1])
        out = await executor.execute(SchedulerOutput(step=step, requests=[request]))  # type: ignore[attr-defined]
        tokens.append(out.results[0].token_id)
    return tokens


async def test_workers_step_in_lockstep_and_leave_nothing_behind(tiny_model: Path) -> None:
    async with open_multiproc_executor(_args(tiny_model, distributed_executor_backend="mp")) as ex:
        single = await _greedy(ex, 6)
        pids = ex.worker_pids
    async with open_multiproc_executor(
        _args(tiny_model, tensor_parallel_size=2, pipeline_parallel_size=2)
    ) as ex:
        assert len(ex.worker_pids) == 4
        assert await _greedy(ex, 6) == single
        pids += ex.worker_pids
    assert not [pid for pid in pids if alive(pid)]


async def test_one_node_listens_on_loopback_and_in_a_private_directory_only(
    tiny_model: Path,
) -> None:
    # --master-addr names a host's address, which one node never needs
    args = _args(tiny_model, tensor_parallel_size=2, master_addr="0.0.0.0")
    async with open_multiproc_executor(args) as ex:
        await ex.execute(_prefill())
        sockets = listening_sockets([*ex.worker_pids, os.getpid()])
        zmq_binds = [ex._ring.handle.overflow_address, ex._results.last_endpoint]
        assert all(e.startswith("ipc://") for e in zmq_binds), zmq_binds
        directories = {Path(e.removeprefix("ipc://")).parent for e in zmq_binds}
        modes = {stat.S_IMODE(d.stat().st_mode) for d in directories}
    # rank 0's store, and each rank's gloo listeners and wake-up socket
    assert {pid for pid, *_ in sockets} >= set(ex.worker_pids)
    assert [s for s in sockets if s[2] != "127.0.0.1"] == []
    assert modes == {0o700}
    assert not any(d.exists() for d in directories)


async def test_an_undecodable_broadcast_is_counted_and_the_next_step_runs(
    tiny_model: Path,
) -> None:
    async with open_multiproc_executor(_args(tiny_model, tensor_parallel_size=2)) as ex:
        await ex.broadcast([WorkerMessageType.EXECUTE.value, b"\xc1 not msgpack"])
        await ex.broadcast([b"\x7f", b"unknown kind"])
        out = await ex.execute(_prefill())
        assert out.results[0].token_id is not None
        assert ex.protocol_errors == 2


async def test_a_killed_worker_fails_the_executor_at_once_and_kills_the_others(
    tiny_model: Path,
) -> None:
    with pytest.raises(BaseExceptionGroup) as caught:
        async with open_multiproc_executor(_args(tiny_model, tensor_parallel_size=2)) as ex:
            await ex.execute(_prefill())
            pids = ex.worker_pids
            os.kill(pids[1], signal.SIGKILL)
            started = time.monotonic()
            # the next step would wait on a collective with the dead rank: the supervisor
            # must cancel it long before the collective timeout
            with trio.fail_after(2):
                await ex.execute(_prefill(step=1))
    assert time.monotonic() - started < 2
    assert caught.group_contains(WorkerDied)
    assert not [pid for pid in pids if alive(pid)]


async def test_a_hung_worker_fails_the_executor_after_the_collective_timeout(
    tiny_model: Path,
) -> None:
    args = _args(tiny_model, tensor_parallel_size=2, distributed_timeout=2.0)
    with pytest.raises(BaseExceptionGroup) as caught:
        async with open_multiproc_executor(args) as ex:
            await ex.execute(_prefill())
            pids = ex.worker_pids
            os.kill(pids[1], signal.SIGSTOP)
            started = time.monotonic()
            with trio.fail_after(10):
                await ex.execute(_prefill(step=1))
    elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 6, elapsed  # the collective timeout, then at once
    assert caught.group_contains(WorkerDied)
    assert not [pid for pid in pids if alive(pid)]


async def test_a_worker_that_cannot_start_fails_the_executor(tmp_path: Path) -> None:
    with pytest.raises(BaseExceptionGroup) as caught:
        async with open_multiproc_executor(
            _args(tmp_path / "no-such-model", tensor_parallel_size=2)
        ):
            pass
    assert caught.group_contains(WorkerDied)


async def test_stopping_while_a_step_is_stuck_in_a_collective_leaves_no_process(
    tiny_model: Path,
) -> None:
    args = _args(tiny_model, tensor_parallel_size=2, distributed_timeout=60.0)
    async with open_multiproc_executor(args) as ex:
        await ex.execute(_prefill())
        pids = ex.worker_pids
        os.kill(pids[1], signal.SIGSTOP)
        await ex.submit(_prefill(step=1))  # rank 0 now waits for rank 1 at an all-reduce
        await trio.sleep(0.5)
        started = time.monotonic()
    # rank 0 leaves although its step never ends; rank 1 is killed by the escalation
    assert time.monotonic() - started < 6
    assert not [pid for pid in pids if alive(pid)]
