"""The trio adapter for pyzmq sockets, over real ZMQ sockets.

Most tests use inproc:// on one context, where ZMQ delivers without its I/O thread, so waits
end as soon as the peer acts; `trio.testing.wait_all_tasks_blocked` stands for "the task is
now parked on the socket". The `fail_after` guards only turn a bug (a hang) into a failure.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
import wire_strategies as ws
import zmq

from triode.fuzz.harnesses.wire import assert_wire_equal
from triode.wire import (
    Encoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    InputDecoder,
    Logprobs,
    OutputDecoder,
    SamplingParams,
    Socket,
    UtilityCall,
    encode_input,
    encode_output,
    topic_for,
)

GUARD = 10  # seconds; only reached when the adapter hangs

_names = itertools.count()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def addr() -> str:
    return f"inproc://test-zsocket-{next(_names)}"


def sync_socket(ctx: zmq.Context, kind: int, *, connect: str, hwm: int = 0) -> zmq.Socket:
    """A plain blocking socket, for a peer whose sends never checkpoint."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(connect)
    return sock


async def wait_parked() -> None:
    """Until every other task is parked; a task that spins makes this fail, not hang."""
    with trio.fail_after(GUARD):
        await trio.testing.wait_all_tasks_blocked()


async def recv_bytes(sock: Socket) -> list[bytes]:
    return await sock.recv_multipart(copy=True)


# (a) Bursts: the fd is edge-triggered, so a burst that arrives while the receiver sleeps
# raises one edge for many messages. Every one must still be received, with nothing after it.

N = 1000


async def test_burst_arriving_while_receiver_is_parked_is_received_in_full(
    ctx: zmq.Context, addr: str
) -> None:
    received: list[list[bytes]] = []
    async with Socket.open(ctx, zmq.PULL, bind=addr) as pull:
        push = sync_socket(ctx, zmq.PUSH, connect=addr)

        async def receive_all() -> None:
            for _ in range(N):
                received.append(await recv_bytes(pull))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_all)
                await wait_parked()
                for i in range(N):
                    push.send_multipart([b"burst", b"%d" % i])
        push.close()

    assert received == [[b"burst", b"%d" % i] for i in range(N)]


async def _burst_is_received_in_full(ctx: zmq.Context, addr: str) -> None:
    """N messages sent before the first receive, and nothing after, all arrive."""
    async with Socket.open(ctx, zmq.PULL, bind=addr) as pull:
        push = sync_socket(ctx, zmq.PUSH, connect=addr)
        for i in range(N):
            push.send(b"%d" % i)
        with trio.fail_after(GUARD):
            received = [await recv_bytes(pull) for _ in range(N)]
        push.close()

    assert received == [[b"%d" % i] for i in range(N)]


async def test_burst_queued_before_the_first_recv_is_received_in_full(
    ctx: zmq.Context, addr: str
) -> None:
    await _burst_is_received_in_full(ctx, addr)


async def test_burst_over_ipc_through_the_io_thread_is_received_in_full(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    await _burst_is_received_in_full(ctx, f"ipc://{tmp_path}/burst")


async def test_burst_between_two_adapters_is_received_in_full(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    addr = f"ipc://{tmp_path}/adapters"
    received: list[list[bytes]] = []
    async with (
        Socket.open(ctx, zmq.PULL, bind=addr, hwm=10) as pull,
        Socket.open(ctx, zmq.PUSH, connect=addr, hwm=10) as push,
    ):

        async def receive_all() -> None:
            for _ in range(N):
                received.append(await recv_bytes(pull))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_all)
                for i in range(N):
                    await push.send_multipart([b"%d" % i])

    assert received == [[b"%d" % i] for i in range(N)]


# (b) Cancellation during recv takes nothing.


async def test_cancelled_recv_loses_no_message(ctx: zmq.Context, addr: str) -> None:
    async with Socket.open(ctx, zmq.PULL, bind=addr) as pull:
        push = sync_socket(ctx, zmq.PUSH, connect=addr)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def parked_recv() -> None:
                with scope:
                    await pull.recv_multipart()
                    pytest.fail("recv returned with nothing sent")

            nursery.start_soon(parked_recv)
            await wait_parked()
            scope.cancel()
        assert scope.cancelled_caught

        push.send(b"after the cancel")
        with trio.fail_after(GUARD):
            assert await recv_bytes(pull) == [b"after the cancel"]
        push.close()


async def test_repeatedly_cancelled_recvs_deliver_every_message_once_in_order(
    ctx: zmq.Context, addr: str
) -> None:
    rng = random.Random(20240611)
    sent: list[bytes] = []
    received: list[bytes] = []
    cancelled = 0
    async with Socket.open(ctx, zmq.PULL, bind=addr) as pull:
        push = sync_socket(ctx, zmq.PUSH, connect=addr)

        def send() -> None:
            sent.append(b"%d" % len(sent))
            push.send(sent[-1])

        async def attempt(scope: trio.CancelScope) -> None:
            with scope:
                [frame] = await recv_bytes(pull)
                received.append(frame)

        for _ in range(300):
            # Fewer sends than attempts on average, so that attempts also find nothing.
            for _ in range(rng.choice([0, 0, 1])):
                send()
            scope = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt, scope)
                when = rng.choice(["before it runs", "while parked", "racing a send"])
                if when != "before it runs":
                    await wait_parked()
                if when == "racing a send":
                    send()
                scope.cancel()
            cancelled += scope.cancelled_caught

        taken_by_attempts = len(received)
        with trio.fail_after(GUARD):
            while len(received) < len(sent):
                [frame] = await recv_bytes(pull)
                received.append(frame)
        with pytest.raises(zmq.Again):
            pull.zmq_socket.recv(zmq.NOBLOCK)
        push.close()

    assert received == sent
    assert cancelled > 50  # the loop did exercise cancellation
    assert taken_by_attempts > 50  # and receiving


# (c) Close.


async def test_close_while_parked_in_recv_raises_closed_resource_error(
    ctx: zmq.Context, addr: str
) -> None:
    pull = Socket.open(ctx, zmq.PULL, bind=addr)
    outcome: list[BaseException] = []

    async def parked_recv() -> None:
        try:
            await pull.recv_multipart()
        except trio.ClosedResourceError as exc:
            outcome.append(exc)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(parked_recv)
            await wait_parked()
            pull.close()

    assert len(outcome) == 1
    assert pull.closed
    assert pull.zmq_socket.closed


async def test_close_while_parked_in_send_raises_closed_resource_error(
    ctx: zmq.Context, addr: str
) -> None:
    push = Socket.open(ctx, zmq.PUSH, bind=addr, hwm=1)  # no peer: sends cannot proceed
    outcome: list[BaseException] = []

    async def parked_send() -> None:
        try:
            await push.send_multipart([b"never"])
        except trio.ClosedResourceError as exc:
            outcome.append(exc)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(parked_send)
            await wait_parked()
            push.close()

    assert len(outcome) == 1


async def test_recv_and_send_after_close_raise_closed_resource_error(
    ctx: zmq.Context, addr: str
) -> None:
    sock = Socket.open(ctx, zmq.PAIR, bind=addr)
    await sock.aclose()
    sock.close()  # idempotent

    with pytest.raises(trio.ClosedResourceError):
        await sock.recv_multipart()
    with pytest.raises(trio.ClosedResourceError):
        await sock.send_multipart([b"x"])


# (d) An idle receiver sleeps in the kernel.


async def test_idle_receiver_does_not_spin(ctx: zmq.Context, addr: str) -> None:
    # Real time on purpose: CPU use over a real second is the thing measured.
    received: list[list[bytes]] = []
    async with Socket.open(ctx, zmq.PULL, bind=addr) as pull:
        push = sync_socket(ctx, zmq.PUSH, connect=addr)

        async def receive_one() -> None:
            received.append(await recv_bytes(pull))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                await trio.sleep(0.05)
                cpu_before = time.process_time()
                await trio.sleep(1.0)
                cpu_used = time.process_time() - cpu_before
                assert received == []  # still parked
                push.send(b"wake up")
        push.close()

    assert cpu_used < 0.2
    assert received == [[b"wake up"]]


# (e) One task per socket.


async def test_second_task_on_a_busy_socket_raises_busy_resource_error(
    ctx: zmq.Context, addr: str
) -> None:
    received: list[list[bytes]] = []
    async with (
        Socket.open(ctx, zmq.PAIR, bind=addr) as sock,
        Socket.open(ctx, zmq.PAIR, connect=addr) as peer,
    ):

        async def owner() -> None:
            received.append(await recv_bytes(sock))

        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(owner)
                await wait_parked()
                with pytest.raises(trio.BusyResourceError):
                    await sock.recv_multipart()
                with pytest.raises(trio.BusyResourceError):
                    await sock.send_multipart([b"from a second task"])
                # The intruder's failure did not release the owner's claim.
                with pytest.raises(trio.BusyResourceError):
                    await sock.recv_multipart()
                await peer.send_multipart([b"for the owner"])
        # Once the owner is done, the socket is free again.
        await peer.send_multipart([b"next"])
        with trio.fail_after(GUARD):
            received.append(await recv_bytes(sock))

    assert received == [[b"for the owner"], [b"next"]]


# (f) Send on a full socket blocks, and cancelling it sends nothing.


async def test_cancelled_send_on_a_full_socket_sends_nothing(ctx: zmq.Context, addr: str) -> None:
    async with (
        Socket.open(ctx, zmq.PUSH, bind=addr, hwm=1) as push,
        Socket.open(ctx, zmq.PULL, connect=addr, hwm=1) as pull,
    ):
        sent = 0
        while True:
            scope = trio.CancelScope()

            async def send(i: int, scope: trio.CancelScope = scope) -> None:
                with scope:
                    await push.send_multipart([b"%d" % i])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, sent)
                await wait_parked()
                scope.cancel()  # a no-op if the send already finished
            if scope.cancelled_caught:
                break
            sent += 1
            assert sent <= 10, "hwm=1 must make a send block"
        assert sent >= 1

        with trio.fail_after(GUARD):
            received = [await recv_bytes(pull) for _ in range(sent)]
            await push.send_multipart([b"after the cancel"])
            received.append(await recv_bytes(pull))

    assert received == [[b"%d" % i] for i in range(sent)] + [[b"after the cancel"]]


async def test_send_parked_on_a_full_socket_completes_when_the_peer_reads(
    ctx: zmq.Context, addr: str
) -> None:
    async with (
        Socket.open(ctx, zmq.PUSH, bind=addr, hwm=1) as push,
        Socket.open(ctx, zmq.PULL, connect=addr, hwm=1) as pull,
    ):
        received: list[list[bytes]] = []
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:

                async def send_many() -> None:
                    for i in range(20):
                        await push.send_multipart([b"%d" % i])

                nursery.start_soon(send_many)
                await wait_parked()
                for _ in range(20):
                    received.append(await recv_bytes(pull))

    assert received == [[b"%d" % i] for i in range(20)]


# The codec over real sockets: frames arrive as zmq.Frame (copy=False) and decode in place.


async def test_input_messages_cross_a_real_socket(ctx: zmq.Context, addr: str) -> None:
    encoder, decoder = Encoder(), InputDecoder()
    request = EngineCoreRequest(
        request_id="r1", prompt_token_ids=list(range(500)), sampling_params=SamplingParams(n=2)
    )
    call = UtilityCall(call_id=1, method="add_lora", args=["adapter", [1.5, None]])
    sent = [
        (EngineCoreRequestType.ADD_REQUEST, request),
        (EngineCoreRequestType.UTILITY, call),
        (EngineCoreRequestType.ABORT_REQUEST, ["r1", "r2"]),
    ]
    async with (
        Socket.open(ctx, zmq.PULL, bind=addr) as pull,
        Socket.open(ctx, zmq.PUSH, connect=addr) as push,
    ):
        for kind, payload in sent:
            await push.send_multipart(encode_input(encoder, kind, payload))
        with trio.fail_after(GUARD):
            received = [decoder.decode(await pull.recv_multipart()) for _ in sent]

    assert_wire_equal(received, sent)


def big_outputs(seed: int) -> EngineCoreOutputs:
    logprobs = Logprobs(
        token_ids=ws.random_array(seed, "int32", (32, 6)),
        logprobs=ws.random_array(seed + 1, "float32", (32, 6)),
        ranks=ws.random_array(seed + 2, "int32", (32,)),
    )
    output = EngineCoreOutput(request_id=f"r{seed}", new_token_ids=[seed], new_logprobs=logprobs)
    return EngineCoreOutputs(outputs=[output], seq=seed)


async def test_subscriber_receives_only_its_topic_with_aux_frames_intact(
    ctx: zmq.Context, addr: str
) -> None:
    encoder, decoder = Encoder(), OutputDecoder()
    received: list[tuple[int, EngineCoreOutputs, list[Any]]] = []
    async with (
        Socket.open(ctx, zmq.PUB, bind=addr) as pub,
        Socket.open(ctx, zmq.SUB, connect=addr, subscribe=topic_for(3)) as sub,
    ):
        with trio.fail_after(GUARD):
            # PUB drops until the subscription has arrived: probe until one gets through.
            probed = False
            while not probed:
                await pub.send_multipart(encode_output(encoder, 3, EngineCoreOutputs(seq=0)))
                with trio.move_on_after(0.01):
                    probed = bool(await sub.recv_multipart())
            for seed in range(1, 6):
                await pub.send_multipart(encode_output(encoder, 4, big_outputs(seed)))
                await pub.send_multipart(encode_output(encoder, 3, big_outputs(seed)))
            while len(received) < 5:
                frames = await sub.recv_multipart()
                client, outputs = decoder.decode(frames)
                if outputs.seq:  # not a late probe
                    received.append((client, outputs, frames))

    assert [client for client, _, _ in received] == [3] * 5
    for seed, (_, outputs, frames) in enumerate(received, start=1):
        assert_wire_equal(outputs, big_outputs(seed))
        # token_ids and logprobs (768 B each) came as aux frames and were decoded in place.
        assert len(frames) == 4
        assert all(isinstance(f, zmq.Frame) for f in frames)
        logprobs = outputs.outputs[0].new_logprobs
        assert logprobs is not None
        assert np.shares_memory(logprobs.token_ids, np.frombuffer(frames[2], np.uint8))
        assert np.shares_memory(logprobs.logprobs, np.frombuffer(frames[3], np.uint8))


async def test_arrays_decoded_from_received_frames_are_read_only(
    ctx: zmq.Context, addr: str
) -> None:
    async with (
        Socket.open(ctx, zmq.PULL, bind=addr) as pull,
        Socket.open(ctx, zmq.PUSH, connect=addr) as push,
    ):
        await push.send_multipart(encode_output(Encoder(), 0, big_outputs(1)))
        with trio.fail_after(GUARD):
            _, outputs = OutputDecoder().decode(await pull.recv_multipart())

    logprobs = outputs.outputs[0].new_logprobs
    assert logprobs is not None
    assert not logprobs.token_ids.flags.writeable
