"""The actor runtime across real processes: handshake, traffic, death, errors, shutdown."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import trio
import zmq
from processes import alive

from triode.actors import ActorDied, HandshakeError, RemoteError, open_child

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}

pytestmark = pytest.mark.slow


def _addresses(tmp_path: Path) -> dict[str, str]:
    return {
        "to_child": f"ipc://{tmp_path}/to-child",
        "to_parent": f"ipc://{tmp_path}/to-parent",
    }


async def test_handshake_delivers_ready_geometry() -> None:
    async with open_child("child_targets:sleep_forever", env=ENV) as child:
        assert child.ready is not None
        assert child.alive
        assert child.pid != os.getpid()


async def test_ready_carries_kv_geometry_from_child(tmp_path: Path) -> None:
    from child_targets import probe_edges

    addresses = _addresses(tmp_path)
    ctx = zmq.Context()
    send, recv = probe_edges(ctx, addresses["to_parent"], addresses["to_child"], bind=True)
    async with send, recv:
        async with open_child("child_targets:echo", addresses=addresses, env=ENV) as child:
            assert child.ready is not None
            assert (child.ready.num_kv_blocks, child.ready.block_size) == (7, 16)
            assert child.ready.max_model_len == 2048
    ctx.term()


async def test_ten_thousand_round_trips_in_order_with_aux_frames(tmp_path: Path) -> None:
    from child_targets import Probe, probe_edges

    n = 10_000
    addresses = _addresses(tmp_path)
    ctx = zmq.Context()
    send, recv = probe_edges(ctx, addresses["to_parent"], addresses["to_child"], bind=True)
    rng = np.random.default_rng(0)
    # Alternate a payload that goes inline with one big enough for its own frame.
    payloads = [rng.standard_normal(4 if i % 2 else 512).astype(np.float32) for i in range(16)]
    received: list[int] = []
    async with send, recv:
        async with open_child("child_targets:echo", addresses=addresses, env=ENV):

            async def produce() -> None:
                for i in range(n):
                    await send.send(Probe(i, payloads[i % len(payloads)]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                async for reply in recv:
                    np.testing.assert_array_equal(reply.payload, payloads[reply.seq % 16] * 2)
                    received.append(reply.seq)
                    if len(received) == n:
                        break
    ctx.term()
    assert received == list(range(n))


async def test_killed_child_is_detected_within_one_second() -> None:
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("child_targets:sleep_forever", env=ENV) as child:
            killed_at = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            await trio.sleep(30)
    detected_after = time.monotonic() - killed_at
    assert excinfo.group_contains(ActorDied)
    assert detected_after < 1.0
    assert child.returncode == -signal.SIGKILL


async def test_death_without_raising_sets_exited_and_error() -> None:
    async with open_child("child_targets:sleep_forever", raise_on_death=False, env=ENV) as child:
        os.kill(child.pid, signal.SIGKILL)
        with trio.fail_after(1):
            await child.exited.wait()
        assert isinstance(child.error, ActorDied)
        assert not child.alive


async def test_child_exception_arrives_as_remote_error_with_traceback() -> None:
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("child_targets:crash_after_ready", env=ENV):
            await trio.sleep(30)
    [error] = _leaves(excinfo.value)
    assert isinstance(error, RemoteError)
    assert error.type_name == "ValueError"
    assert error.remote_message == "the probe asked this actor to fail"
    assert "crash_after_ready" in error.remote_traceback
    assert "Traceback (most recent call last)" in str(error)
    assert error.returncode == 1


async def test_failure_before_ready_fails_the_open() -> None:
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("child_targets:crash_before_ready", env=ENV):
            pytest.fail("the block must not run")
    [error] = _leaves(excinfo.value)
    assert isinstance(error, RemoteError)
    assert error.type_name == "RuntimeError"
    assert "no model here" in error.remote_message


async def test_unimportable_target_is_a_remote_error() -> None:
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("child_targets:no_such_function", env=ENV):
            pytest.fail("the block must not run")
    [error] = _leaves(excinfo.value)
    assert isinstance(error, RemoteError)
    assert error.type_name == "AttributeError"


async def test_protocol_version_mismatch_is_a_clear_error() -> None:
    command = (sys.executable, str(HERE / "wrong_version_child.py"))
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("unused:unused", command=command, env=ENV):
            pytest.fail("the block must not run")
    [error] = _leaves(excinfo.value)
    assert isinstance(error, HandshakeError)
    assert "protocol version" in str(error)


async def test_not_ready_in_time_times_out() -> None:
    with pytest.raises(ExceptionGroup) as excinfo:
        async with open_child("child_targets:never_ready", ready_timeout=1.5, env=ENV):
            pytest.fail("the block must not run")
    assert excinfo.group_contains(trio.TooSlowError)


async def test_graceful_shutdown_by_message() -> None:
    async with open_child("child_targets:sleep_forever", env=ENV) as child:
        pass
    assert child.stop_escalation == "graceful"
    assert child.returncode == 0


async def test_shutdown_escalates_to_sigterm() -> None:
    async with open_child("child_targets:ignore_shutdown", shutdown_timeout=0.5, env=ENV) as child:
        pass
    assert child.stop_escalation == "terminated"
    assert child.returncode == -signal.SIGTERM


async def test_shutdown_escalates_to_sigkill() -> None:
    async with open_child(
        "child_targets:ignore_sigterm", shutdown_timeout=0.3, terminate_timeout=0.3, env=ENV
    ) as child:
        pass
    assert child.stop_escalation == "killed"
    assert child.returncode == -signal.SIGKILL


async def test_cancelling_the_parent_still_stops_the_child() -> None:
    with trio.move_on_after(1):
        async with open_child("child_targets:sleep_forever", env=ENV) as child:
            await trio.sleep_forever()
    assert child.returncode == 0
    assert child.stop_escalation == "graceful"


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


async def test_child_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import trio\n"
        "from triode.actors import open_child\n"
        "async def main():\n"
        "    async with open_child('child_targets:sleep_forever') as child:\n"
        "        print(child.pid, flush=True)\n"
        "        await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    parent = await trio.lowlevel.open_process(
        [sys.executable, str(script)], stdout=-1, env={**os.environ, **ENV}
    )
    try:
        with trio.fail_after(30):
            line = await parent.stdout.receive_some()
        child_pid = int(line.split()[0])
        parent.kill()
        await parent.wait()
        with trio.fail_after(2):
            while alive(child_pid):  # noqa: ASYNC110 - another process; we can only poll
                await trio.sleep(0.05)
    finally:
        parent.kill()
        await parent.wait()
