"""The engine core's publisher: the one owner of its XPUB socket, over which outputs leave
(`[topic, msgpack, *aux]` per client).

XPUB rather than PUB because it reports subscriptions: an expected client's outputs wait until
its SUB is confirmed, so none is published into the void (ZMQ's slow-joiner problem), and a
client whose subscription ends (its process died) is reported to the engine core, which aborts
its requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import trio

from triode.wire import Encoder, EngineCoreOutputs, Recorder, Socket, encode_output
from triode.wire.framing import client_of_topic

# PUB drops at its high-water mark; this is far above what a healthy client lags behind by,
# and sequence numbers catch the rest.
OUTPUT_HWM = 100_000
# How many messages wait for an expected client whose SUB is not confirmed yet (a restarted
# edge's first request can overtake its subscription); beyond that the oldest drop, and the
# client sees the gap in its sequence numbers.
MAX_HELD_OUTPUTS = 10_000


class Publisher:
    """Sends each client's outputs under its topic, stamped with the engine's index, the
    topic's next sequence number and the time; `on_unsubscribed(client)` is called when a
    client's subscription ends."""

    def __init__(
        self,
        socket: Socket,
        inbox: trio.MemoryReceiveChannel[tuple[int, EngineCoreOutputs]],
        *,
        num_clients: int,
        engine_index: int,
        on_unsubscribed: Callable[[int], None],
        recorder: Recorder | None = None,
    ) -> None:
        self.socket = socket
        self.inbox = inbox
        self.num_clients = num_clients
        self.engine_index = engine_index
        self.on_unsubscribed = on_unsubscribed
        # what the socket sends goes here too while the engine records (--record-wire)
        self.recorder = recorder

    async def run(self) -> None:
        """The XPUB socket's one owner: sends each client's outputs under its topic, and reads
        the subscriptions the socket reports. A client's topic carries nothing until its SUB
        is confirmed (messages wait, bounded, until then); a client whose subscription ends
        (its process died) has its requests aborted (`on_unsubscribed`), and its topic starts
        again at sequence 0 for whoever subscribes next."""
        encoder = Encoder()
        topics = _Topics(self.num_clients)
        while True:
            item, frames = await _next_output_or_subscription(self.inbox, self.socket)
            if frames is not None:
                self._take_subscription(topics, frames[0])
                for client, outputs in topics.released():
                    await self._send_output(encoder, topics, client, outputs)
            if item is not None:
                client, outputs = item
                if topics.hold(client, outputs):
                    continue
                await self._send_output(encoder, topics, client, outputs)

    async def _send_output(
        self, encoder: Encoder, topics: _Topics, client: int, outputs: EngineCoreOutputs
    ) -> None:
        outputs.engine_index = self.engine_index
        outputs.seq = topics.next_seq(client)
        outputs.timestamp = time.time()
        frames = encode_output(encoder, client, outputs)
        if self.recorder is not None:
            self.recorder.record("out", frames)
        await self.socket.send_multipart(frames)

    def _take_subscription(self, topics: _Topics, event: bytes) -> None:
        client = client_of_topic(event[1:])
        if client is None:
            return
        if event[:1] == b"\x01":
            topics.subscribed(client)
        elif event[:1] == b"\x00":
            topics.unsubscribed(client)
            self.on_unsubscribed(client)


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
