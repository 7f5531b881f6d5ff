"""A shared-memory broadcast ring: one writer (the engine core) to N reader processes (model
worker ranks), carrying each step's scheduler output, a list of msgpack frames.

The shape is vLLM's `MessageQueue`/`ShmRingBuffer`; the segment's layout is in `shm_segment`.
The writer copies a message into the next chunk and publishes its sequence number; each reader
copies it out and sets its own read byte. A chunk is reused only once every live reader has
read it, so a slow reader holds the writer: that is the back-pressure.

ZMQ (one XPUB bound by the writer, one SUB per reader) carries what shared memory cannot:
messages too big for a chunk (the chunk holds a marker, so the message keeps its place in the
order), and, when `remote_readers > 0`, every message for the readers on other nodes. XPUB, not
PUB, because the writer must know who is subscribed before it relies on ZMQ: each reader
subscribes a hello topic naming itself, and `wait_for_subscribers` (and any write that needs
ZMQ) waits until each live reader's hello arrived. SNDHWM is 0: the writer never drops.

Waiting (`ring_wait`): a waiter spins with `os.sched_yield` for `SPIN_S`, then sleeps, doubling
from `MIN_PAUSE_S` up to `MAX_PAUSE_S`. A reader still idle after `SLEEP_AFTER_S` sets its
sleeping byte, checks the chunk once more and blocks on a loopback UDP socket; a writer that
sees a sleeping byte after publishing sends that reader one datagram, from a socket bound on
loopback whose port the handle names; datagrams from any other sender are counted and dropped (a
wake-up carries no data, but a stranger's must not keep a reader busy). Both sides fence between
their store and their load, so one of them sees the other; a lost datagram costs at most
`POLL_SLICE_S`, never a hang. UDP rather than the ZMQ SUB socket: a ZMQ wake-up passes through
both sides' I/O threads.

Measured on a loaded 2-core VM (CPython 3.11), one reader process: write + read of a 20 KB
message in one process, 8 us; from `write` to `read` returning, 50 us while the reader spins
and 320 us (p90 450 us) for a reader blocked on UDP, of which the datagram is 200 us; the same
wake-up over ZMQ took 450-520 us (p90 above 1 ms). A reader blocked for a second uses 4 ms of
CPU; a writer held by a reader that does not read, 3% of a core.

Dead readers: a reader process that dies holds the ring forever. `write` never waits
unboundedly when given a `timeout` (RingTimeout names the readers it waited on) or a `cancelled`
event (RingClosed); a supervisor that knows a reader died calls `mark_reader_dead`, and the
writer stops waiting for it. A writer that dies without `close` leaves readers waiting likewise,
until their own timeout or `cancelled`.

Every call here is synchronous and blocking: run it in a thread (`trio.to_thread.run_sync`),
with `cancelled` set from trio to stop it. A writer or reader is used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from .errors import ProtocolError
from .ring_wait import SLEEP_AFTER_S, Pacer, RingClosed, check_wait, deadline_after, poll_ms
from .shm_segment import RingHandle, RingSegment, fence

DEFAULT_CHUNK_BYTES = 256 * 1024  # 5x the largest usual step output; bigger ones go on ZMQ
DEFAULT_N_CHUNKS = 8  # the writer may run 8 steps ahead of the slowest reader: 2 MiB in all

_LINGER_MS = 1000  # a closing writer's last messages still reach remote readers
_LOOPBACK = "127.0.0.1"

# Topics: SUB filters by prefix, so remote readers subscribe b"m" and get both kinds.
_RING_COPY = b"m"  # every message, for remote readers
_OVERFLOW = b"mo"  # a message too big for a chunk, for every reader
_CLOSE = b"x"
_LOCAL_HELLO = b"hl"
_REMOTE_HELLO = b"hr"


def _hello(kind: bytes, index: int) -> bytes:
    return kind + index.to_bytes(4, "little")


class ShmRingWriter:
    """The writing end; creates the segment and binds the XPUB socket.

    `overflow_address` is where the XPUB binds; None binds an ephemeral loopback port (enough
    when every reader is on this host). Remote readers need a reachable address: give one that
    names an interface, since `handle.overflow_address` is the bound endpoint as ZMQ reports it.
    """

    def __init__(
        self,
        n_readers: int,
        *,
        zmq_context: zmq.Context,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        n_chunks: int = DEFAULT_N_CHUNKS,
        overflow_address: str | None = None,
        remote_readers: int = 0,
        socket_options: Sequence[tuple[int, Any]] = (),
    ) -> None:
        """`socket_options` are set on the XPUB before it binds: the CurveZMQ server keys of a
        ring that readers on other nodes reach."""
        if remote_readers and overflow_address is None:
            raise ValueError("remote readers need an overflow_address they can reach")
        if n_readers < 0 or remote_readers < 0:
            raise ValueError("reader counts must not be negative")
        with contextlib.ExitStack() as undo:
            self._segment = RingSegment.create(n_readers, n_chunks, chunk_bytes)
            undo.callback(self._segment.unlink)
            undo.callback(self._segment.close)
            self._pub = pub = zmq_context.socket(zmq.XPUB)
            undo.callback(pub.close, linger=0)
            for option, value in socket_options:
                pub.setsockopt(option, value)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's hello, not just the first
            pub.setsockopt(zmq.LINGER, _LINGER_MS)
            pub.bind(overflow_address or f"tcp://{_LOOPBACK}:*")
            self._waker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            undo.callback(self._waker.close)
            # bound, so that readers know the one sender to take wake-ups from
            self._waker.bind((_LOOPBACK, 0))
            undo.pop_all()
        address = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._handle = RingHandle(
            self._segment.name,
            n_readers,
            chunk_bytes,
            n_chunks,
            address,
            writer_wake_port=self._waker.getsockname()[1],
        )
        self._remote_readers = remote_readers
        self._live = list(range(n_readers))
        self._live_remote = set(range(remote_readers))
        self._subscribed: set[bytes] = set()
        self._next = 0
        self._closed = False
        self.overflowed = 0
        """How many messages went on ZMQ because they did not fit a chunk."""

    @property
    def handle(self) -> RingHandle:
        return self._handle

    def write(
        self,
        frames: Sequence[Any],
        *,
        timeout: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> None:
        """Broadcast one message: a list of byte buffers (bytes, memoryview, zmq.Frame).

        Blocks while the next chunk holds a message some live reader has not read, and, for a
        message that needs ZMQ, until every reader that must receive it has subscribed.
        RingTimeout or RingClosed mean nothing was sent; calling again sends this message. Frames
        that go on ZMQ are sent without a copy: do not change their memory afterwards.
        """
        if self._closed:
            raise RingClosed("the writer is closed")
        views = [memoryview(frame).cast("B") for frame in frames]
        body_len = sum(map(len, views))
        deadline = deadline_after(timeout)
        seq = self._next
        chunk = seq % self._segment.n_chunks
        self._wait_for_chunk(chunk, seq, deadline, cancelled)
        inline = self._segment.fits(len(views), body_len)
        if not inline or self._remote_readers:
            self._wait_for_hellos(deadline, cancelled, local=not inline)
            topic = _RING_COPY if inline else _OVERFLOW
            self._pub.send_multipart([topic, seq.to_bytes(8, "little"), *views], copy=False)
        if inline:
            self._segment.write_frames(chunk, views, body_len)
        else:
            self._segment.write_overflow_marker(chunk)
            self.overflowed += 1
        self._segment.publish(chunk, seq)
        self._next = seq + 1
        self._wake_sleepers()

    def _wake_sleepers(self) -> None:
        for r in self._live:
            if self._segment.sleeping(r):
                try:
                    self._waker.sendto(b"!", (_LOOPBACK, self._segment.wake_port(r)))
                except OSError:
                    pass  # the reader wakes at the end of its poll slice instead

    def _wait_for_chunk(
        self, chunk: int, seq: int, deadline: float, cancelled: threading.Event | None
    ) -> None:
        if seq < self._segment.n_chunks:
            return
        tag = self._segment.tag(seq - self._segment.n_chunks)
        pacer = Pacer()
        while True:
            waiting = [r for r in self._live if self._segment.read_flag(chunk, r) != tag]
            if not waiting:
                fence()  # the readers' copies are done before this chunk is overwritten
                return
            what = f"waiting for readers {waiting} to read message {seq - self._segment.n_chunks}"
            check_wait(deadline, cancelled, what, waiting)
            pacer.pause()

    def wait_for_subscribers(self, timeout: float | None = None) -> None:
        """Block until every live reader, local and remote, has subscribed to the ZMQ side.
        Writes that need ZMQ wait for this themselves; waiting up front, with a timeout, finds a
        reader that never started before the first step is due."""
        self._wait_for_hellos(deadline_after(timeout), None, local=True)

    def _wait_for_hellos(
        self, deadline: float, cancelled: threading.Event | None, *, local: bool
    ) -> None:
        while missing := self._missing_hellos(local):
            check_wait(
                deadline, cancelled, f"waiting for readers to subscribe ({len(missing)} left)"
            )
            if self._pub.poll(poll_ms(deadline), zmq.POLLIN):
                self._take_subscriptions()

    def _missing_hellos(self, local: bool) -> list[bytes]:
        self._take_subscriptions()
        wanted = [_hello(_REMOTE_HELLO, r) for r in self._live_remote]
        if local:
            wanted += [_hello(_LOCAL_HELLO, r) for r in self._live]
        return [hello for hello in wanted if hello not in self._subscribed]

    def _take_subscriptions(self) -> None:
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self._subscribed.add(message[1:])

    def mark_reader_dead(self, index: int, *, remote: bool = False) -> None:
        """Stop waiting for reader `index` (a local one unless `remote`): for a supervisor that
        saw its process die. Its unread messages are overwritten; it must not read again."""
        if remote:
            self._live_remote.discard(index)
        elif index in self._live:
            self._live.remove(index)

    def close(self) -> None:
        """Mark the ring closed, wake readers, unlink the segment. Idempotent. Readers still
        read what was written before; then they raise RingClosed."""
        if self._closed:
            return
        self._closed = True
        self._segment.set_closed()
        try:
            self._wake_sleepers()
            self._pub.send(_CLOSE)
            self._pub.close()
            self._waker.close()
        finally:
            self._segment.close()
            self._segment.unlink()

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmRingReader:
    """Reader `reader_index` of a ring. Local readers map the segment; a remote one (on another
    node: `remote=True`, indexed among the remote readers) reads every message from ZMQ."""

    def __init__(
        self,
        handle: RingHandle,
        reader_index: int,
        *,
        zmq_context: zmq.Context,
        remote: bool = False,
        socket_options: Sequence[tuple[int, Any]] = (),
    ) -> None:
        """`socket_options` are set on the SUB before it connects (the writer's CurveZMQ
        client keys, where it needs them)."""
        if reader_index < 0 or (not remote and reader_index >= handle.n_readers):
            raise ValueError(f"reader {reader_index} of a ring with {handle.n_readers} readers")
        self._index = reader_index
        self._writer = (_LOOPBACK, handle.writer_wake_port)
        self.foreign_wakes = 0
        """Datagrams on the wake-up socket from anyone but the writer: dropped."""
        with contextlib.ExitStack() as undo:
            self._segment = None if remote else RingSegment.attach(handle)
            if self._segment is not None:
                undo.callback(self._segment.close)
            self._sub = sub = zmq_context.socket(zmq.SUB)
            undo.callback(sub.close, linger=0)
            for option, value in socket_options:
                sub.setsockopt(option, value)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.LINGER, 0)
            topics = [_RING_COPY, _CLOSE] if remote else [_OVERFLOW]
            # The hello goes last: when the writer sees it, the other subscriptions are in.
            topics.append(_hello(_REMOTE_HELLO if remote else _LOCAL_HELLO, reader_index))
            for topic in topics:
                sub.setsockopt(zmq.SUBSCRIBE, topic)
            sub.connect(handle.overflow_address)
            # A local reader blocks on this between messages; the writer's datagram wakes it.
            self._wake = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            undo.callback(self._wake.close)
            self._wake.setblocking(False)
            self._wake.bind((_LOOPBACK, 0))
            self._wake_poll = select.poll()
            self._wake_poll.register(self._wake, select.POLLIN)
            if self._segment is not None:
                self._segment.set_wake_port(reader_index, self._wake.getsockname()[1])
            undo.pop_all()
        self._next = 0
        # ZMQ messages received ahead of their turn: (seq, frames), or None for one that did
        # not decode.
        self._early: deque[tuple[int, list[memoryview]] | None] = deque()
        self._writer_closed = False
        self._closed = False

    def read(
        self, *, timeout: float | None = None, cancelled: threading.Event | None = None
    ) -> list[memoryview]:
        """The next message's frames, copied out of shared memory (they stay valid).

        ProtocolError for a message that does not decode; it counts as read, and the next call
        returns the next message. RingTimeout or RingClosed (closed ring, `cancelled` set) mean
        no message was taken.
        """
        if self._closed:
            raise RingClosed("the reader is closed")
        deadline = deadline_after(timeout)
        if self._segment is None:
            return self._read_remote(deadline, cancelled)
        seq = self._next
        chunk = seq % self._segment.n_chunks
        self._wait_for_message(chunk, seq, deadline, cancelled)
        try:
            frames = self._segment.read_frames(chunk)
            if frames is None:
                frames = self._overflow(seq, deadline, cancelled)
        except ProtocolError:
            self._done(chunk, seq)
            raise
        self._done(chunk, seq)
        return frames

    def _done(self, chunk: int, seq: int) -> None:
        assert self._segment is not None
        self._segment.set_read_flag(chunk, self._index, self._segment.tag(seq))
        self._next = seq + 1

    def _written(self, chunk: int, seq: int) -> bool:
        """Whether message `seq` is in `chunk`; RingClosed if it never will be."""
        assert self._segment is not None
        closed = self._segment.closed  # read first: the writer sets it after its last seq
        if self._segment.written(chunk) == seq + 1:
            fence()  # the payload is read after the seq
            return True
        if closed:
            raise RingClosed(f"the writer closed the ring before message {seq}")
        return False

    def _wait_for_message(
        self, chunk: int, seq: int, deadline: float, cancelled: threading.Event | None
    ) -> None:
        pacer = Pacer()
        while not self._written(chunk, seq):
            if time.monotonic() - pacer.start >= SLEEP_AFTER_S:
                self._sleep_for_message(chunk, seq, deadline, cancelled)
                return
            check_wait(deadline, cancelled, f"waiting for message {seq}")
            pacer.pause()

    def _sleep_for_message(
        self, chunk: int, seq: int, deadline: float, cancelled: threading.Event | None
    ) -> None:
        assert self._segment is not None
        self._segment.set_sleeping(self._index, True)
        try:
            while not self._written(chunk, seq):
                check_wait(deadline, cancelled, f"waiting for message {seq}")
                if self._wake_poll.poll(poll_ms(deadline)):
                    self._drain_wakes()
        finally:
            self._segment.set_sleeping(self._index, False)

    def _drain_wakes(self) -> None:
        """Take every queued datagram; what did not come from the writer is counted. Either way
        a wake-up only makes the reader look at the ring again."""
        while True:
            try:
                _, sender = self._wake.recvfrom(16)
            except BlockingIOError:
                return
            if sender != self._writer:
                self.foreign_wakes += 1

    def _receive(self, deadline: float) -> None:
        """Wait (a slice at most) for ZMQ messages and keep them for their turn."""
        if not self._sub.poll(poll_ms(deadline), zmq.POLLIN):
            return
        while True:
            try:
                message = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if message[0].bytes == _CLOSE:
                self._writer_closed = True
                continue
            try:
                self._early.append(_decode(message))
            except ProtocolError:
                self._early.append(None)

    def _overflow(
        self, seq: int, deadline: float, cancelled: threading.Event | None
    ) -> list[memoryview]:
        while True:
            while self._early:
                early = self._early[0]
                if early is not None and early[0] > seq:
                    raise ProtocolError(f"message {seq} never arrived on ZMQ")
                self._early.popleft()
                if early is None:
                    raise ProtocolError(f"undecodable ZMQ message in place of message {seq}")
                if early[0] == seq:
                    return early[1]
            check_wait(deadline, cancelled, f"waiting for message {seq} on ZMQ")
            self._receive(deadline)

    def _read_remote(self, deadline: float, cancelled: threading.Event | None) -> list[memoryview]:
        while True:
            if self._early:
                early = self._early.popleft()
                if early is None:
                    raise ProtocolError("undecodable ZMQ message")
                seq, frames = early
                if seq < self._next:
                    continue  # a duplicate of one already read
                if seq > self._next:
                    self._early.appendleft(early)  # the next read returns it
                    missed, self._next = self._next, seq
                    raise ProtocolError(f"messages {missed} to {seq - 1} never arrived")
                self._next = seq + 1
                return frames
            if self._writer_closed:
                raise RingClosed("the writer closed the ring")
            check_wait(deadline, cancelled, "waiting for a message on ZMQ")
            self._receive(deadline)

    def close(self) -> None:
        """Idempotent. The segment stays for the other readers; the writer unlinks it."""
        if self._closed:
            return
        self._closed = True
        self._sub.close(linger=0)
        self._wake.close()
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(message: Sequence[zmq.Frame]) -> tuple[int, list[memoryview]]:
    """A ZMQ ring message: [topic, seq u64, *frames]."""
    if len(message) < 2 or message[0].bytes not in (_RING_COPY, _OVERFLOW):
        raise ProtocolError("not a ring message")
    if len(message[1]) != 8:
        raise ProtocolError("a ring message's seq frame is not 8 bytes")
    return int.from_bytes(message[1].bytes, "little"), [frame.buffer for frame in message[2:]]
