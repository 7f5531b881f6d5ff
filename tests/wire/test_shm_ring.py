"""The shared-memory broadcast ring, with real reader processes where processes matter.

Reader processes run `child_main` below (`python -W error -c`), report what they read as one
JSON line and exit; the `spawn` fixture fails a test that leaves one running. Timeouts named
GUARD are only reached when the ring hangs.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from triode.wire import (
    ProtocolError,
    RingClosed,
    RingHandle,
    RingTimeout,
    ShmRingReader,
    ShmRingWriter,
)
from triode.wire.ring_wait import POLL_SLICE_S, SLEEP_AFTER_S
from triode.wire.shm_segment import RingSegment

GUARD = 20.0
HERE = Path(__file__).resolve().parent
HEADER = struct.Struct("=BxxxII")  # a chunk's header, as shm_segment lays it out


# Reader processes


def child_main() -> None:
    """A reader process: argv is the handle (JSON) and options (JSON); prints "ready", then a
    JSON result."""
    handle = msgspec.json.decode(sys.argv[1], type=RingHandle)
    options = json.loads(sys.argv[2])
    ctx = zmq.Context()
    remote = options.get("remote", False)
    with ShmRingReader(handle, options["index"], zmq_context=ctx, remote=remote) as reader:
        print("ready", flush=True)
        result = _idle_rounds(reader, options) if "idle" in options else _read(reader, options)
    ctx.term()
    print(json.dumps(result), flush=True)


def _read(reader: ShmRingReader, options: dict[str, Any]) -> dict[str, Any]:
    time.sleep(options.get("delay_first", 0))
    digests = []
    for _ in range(options["count"]):
        try:
            digests.append(digest(reader.read(timeout=GUARD)))
        except ProtocolError as e:
            digests.append(f"ProtocolError: {e}")
        time.sleep(options.get("delay_each", 0))
    return {"digests": digests}


def _idle_rounds(reader: ShmRingReader, options: dict[str, Any]) -> dict[str, Any]:
    """Per round: CPU time spent blocked in read, and latency from the stamped write."""
    rounds = []
    for _ in options["idle"]:
        print("reading", flush=True)
        cpu = time.process_time()
        frames = reader.read(timeout=GUARD)
        woke = time.monotonic()
        (stamp,) = struct.unpack("d", frames[0])
        rounds.append({"cpu": time.process_time() - cpu, "latency": woke - stamp})
    return {"rounds": rounds}


class Child:
    def __init__(self, handle: RingHandle, options: dict[str, Any]) -> None:
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_shm_ring as t; "
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-c", code + "t.child_main()",
             msgspec.json.encode(handle).decode(), json.dumps(options)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))

    def end(self) -> None:
        """Kill the process if it still runs; reap it and close its pipes."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._pump_thread.join(GUARD)
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            pipe.close()

    def expect(self, line: str) -> None:
        try:
            got = self._lines.get(timeout=GUARD)
        except queue.Empty:
            raise AssertionError(f"reader {self.proc.pid} said nothing") from None
        assert got == line, f"reader said {got!r}"

    def result(self) -> dict[str, Any]:
        """Wait for the process to exit cleanly (nothing on stderr) and return its result."""
        self.proc.wait(timeout=GUARD)
        assert self.proc.stderr is not None
        errors = self.proc.stderr.read()
        assert self.proc.returncode == 0 and not errors, errors
        return json.loads(self._lines.get(timeout=GUARD))


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(handle: RingHandle, **options: Any) -> Child:
        child = Child(handle, options)
        started.append(child)
        return child

    yield start
    left = [child.proc.pid for child in started if child.proc.poll() is None]
    for child in started:
        child.end()
    assert not left, f"the test left reader processes {left} running"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def digest(frames: list[Any]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for frame in frames:
        h.update(len(frame).to_bytes(4, "little") + bytes(frame))
    return h.hexdigest()


def random_messages(seed: int, count: int, sizes: list[int]) -> list[list[bytes]]:
    rng = random.Random(seed)
    return [
        [rng.randbytes(rng.choice(sizes)) for _ in range(rng.choice([0, 1, 1, 2, 3, 6]))]
        for _ in range(count)
    ]


def segment_exists(handle: RingHandle) -> bool:
    try:
        RingSegment.attach(handle).close()
    except FileNotFoundError:
        return False
    return True


# One process


@pytest.mark.parametrize(
    "frames",
    [[], [b""], [b"", b"", b""], [b"step"], [b"\x00" * 5000, b"", b"x"], [bytes(range(256))] * 9],
)
def test_frames_round_trip_as_separate_copies(ctx: zmq.Context, frames: list[bytes]) -> None:
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=16384, n_chunks=1) as writer:
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            writer.write([memoryview(f) if i % 2 else zmq.Frame(f) for i, f in enumerate(frames)])
            got = reader.read(timeout=GUARD)
            writer.write([b"\xff" * 16000])  # overwrites the chunk once read

            assert [bytes(f) for f in got] == frames
            assert writer.overflowed == 0


def test_a_message_one_byte_over_a_chunk_goes_on_zmq_in_its_place(ctx: zmq.Context) -> None:
    chunk = 1024
    fits = [b"a" * (chunk - HEADER.size - 8 - 10), b"b" * 10]  # header + 2 lengths + body
    over = [fits[0] + b"!", fits[1]]
    sequence = [fits, over, [b"small"], over, over, fits, [b""]]
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=chunk, n_chunks=8) as writer:
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            writer.wait_for_subscribers(timeout=GUARD)
            for message in sequence:
                writer.write(message, timeout=GUARD)
            got = [reader.read(timeout=GUARD) for _ in sequence]

            assert [[bytes(f) for f in m] for m in got] == sequence
            assert writer.overflowed == 3


def test_wrap_around_keeps_order_through_many_laps_and_a_full_ring_refuses(
    ctx: zmq.Context,
) -> None:
    n_chunks = 4
    count = 255 * n_chunks * 2 + 37  # the lap tag wraps twice
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=256, n_chunks=n_chunks) as writer:
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            read = 0
            refused = 0
            for seq in range(count):
                if seq - read == n_chunks:  # the reader lags a full ring behind
                    with pytest.raises(RingTimeout) as excinfo:
                        writer.write([b"never"], timeout=0)
                    assert excinfo.value.waiting_on == (0,)
                    refused += 1
                    assert reader.read(timeout=0)[0] == read.to_bytes(4, "little")
                    read += 1
                writer.write([seq.to_bytes(4, "little")], timeout=0)
            while read < count:
                assert reader.read(timeout=0)[0] == read.to_bytes(4, "little")
                read += 1
            with pytest.raises(RingTimeout):
                reader.read(timeout=0.01)

    assert refused == count - n_chunks


def _corrupt_headers(chunk_bytes: int) -> dict[str, bytes]:
    return {
        "length beyond the chunk": HEADER.pack(1, 1, chunk_bytes) + struct.pack("=I", chunk_bytes),
        "huge frame count": HEADER.pack(1, 0xFFFFFFFF, 4) + struct.pack("=I", 4),
        "lengths that do not add up": HEADER.pack(1, 2, 10) + struct.pack("=II", 3, 4),
        "a length beyond the body": HEADER.pack(1, 2, 8) + struct.pack("=II", 0xFFFFFFF8, 16),
        "unknown kind": HEADER.pack(7, 1, 1) + struct.pack("=I", 1) + b"x",
        "all zeros": b"",
    }


@pytest.mark.parametrize("corruption", list(_corrupt_headers(512)))
def test_a_corrupted_chunk_header_is_a_protocol_error_and_the_next_message_arrives(
    ctx: zmq.Context, corruption: str
) -> None:
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=512, n_chunks=1) as writer:
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            writer.write([b"first"])
            segment = RingSegment.attach(writer.handle)
            segment.overwrite_chunk(0, _corrupt_headers(512)[corruption])
            segment.close()

            with pytest.raises(ProtocolError):
                reader.read(timeout=GUARD)
            writer.write([b"second"], timeout=0)  # the bad chunk counted as read
            assert [bytes(f) for f in reader.read(timeout=GUARD)] == [b"second"]


def test_garbage_on_the_zmq_path_is_a_protocol_error_and_the_next_message_arrives(
    ctx: zmq.Context,
) -> None:
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    handle = RingHandle("unused", 0, 64, 1, pub.getsockopt_string(zmq.LAST_ENDPOINT))
    with ShmRingReader(handle, 0, zmq_context=ctx, remote=True) as reader:
        while not pub.recv().startswith(b"\x01hr"):  # the reader's hello: it is subscribed
            pass
        garbage = [[b"m"], [b"m", b"short"], [b"mz", bytes(8)], [b"m", b"\xff" * 9, b"x"]]
        for message in garbage:
            pub.send_multipart(message)
        pub.send_multipart([b"m", bytes(8), b"good"])

        for _ in garbage:
            with pytest.raises(ProtocolError):
                reader.read(timeout=GUARD)
        assert [bytes(f) for f in reader.read(timeout=GUARD)] == [b"good"]
    pub.close(linger=0)


def test_cancelling_a_blocked_write_stops_it_promptly(ctx: zmq.Context) -> None:
    cancelled = threading.Event()
    outcome: list[BaseException] = []
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=256, n_chunks=2) as writer:
        writer.write([b"0"])
        writer.write([b"1"])  # the ring is full: reader 0 never reads

        def blocked_write() -> None:
            try:
                writer.write([b"2"], cancelled=cancelled)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=blocked_write)
        thread.start()
        time.sleep(0.2)
        assert not outcome  # still blocked
        cancelled.set()
        set_at = time.monotonic()
        thread.join(GUARD)
        stopped_after = time.monotonic() - set_at

    assert len(outcome) == 1 and isinstance(outcome[0], RingClosed)
    assert stopped_after < 0.1


def test_readers_read_what_was_written_then_see_the_ring_closed(ctx: zmq.Context) -> None:
    writer = ShmRingWriter(2, zmq_context=ctx, chunk_bytes=256, n_chunks=4)
    reader = ShmRingReader(writer.handle, 1, zmq_context=ctx)
    writer.write([b"last"])
    writer.close()
    writer.close()

    assert not segment_exists(writer.handle)
    assert [bytes(f) for f in reader.read(timeout=GUARD)] == [b"last"]
    with pytest.raises(RingClosed):
        reader.read(timeout=GUARD)
    with pytest.raises(RingClosed):
        writer.write([b"late"])
    reader.close()
    reader.close()
    with pytest.raises(RingClosed):
        reader.read()


def test_wake_ups_from_anyone_but_the_writer_are_counted_and_dropped(ctx: zmq.Context) -> None:
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=256, n_chunks=2) as writer:
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            port = reader._wake.getsockname()[1]
            assert reader._wake.getsockname()[0] == "127.0.0.1"
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
                for _ in range(3):
                    stranger.sendto(b"!" * 4096, ("127.0.0.1", port))
                with pytest.raises(RingTimeout):
                    reader.read(timeout=0.2)  # woken three times, each time for nothing
            assert reader.foreign_wakes == 3

            got: list[list[Any]] = []
            thread = threading.Thread(target=lambda: got.append(reader.read(timeout=GUARD)))
            thread.start()
            deadline = time.monotonic() + GUARD
            while not writer._segment.sleeping(0) and time.monotonic() < deadline:
                time.sleep(0.001)
            writer.write([b"from the writer"])  # the reader sleeps: this sends its wake-up
            thread.join(GUARD)

            assert [bytes(f) for f in got[0]] == [b"from the writer"]
            assert reader.foreign_wakes == 3
            assert writer.handle.writer_wake_port == writer._waker.getsockname()[1]


# Reader processes


def test_three_reader_processes_each_get_every_message_in_order(
    ctx: zmq.Context, spawn: Callable[..., Child]
) -> None:
    messages = random_messages(1, 300, [0, 1, 40, 700, 3000, 20000])
    with ShmRingWriter(3, zmq_context=ctx, chunk_bytes=8192, n_chunks=4) as writer:
        children = [
            spawn(writer.handle, index=i, count=len(messages), delay_each=0.001 * (i == 2))
            for i in range(3)
        ]
        for child in children:
            child.expect("ready")
        writer.wait_for_subscribers(timeout=GUARD)
        for message in messages:
            writer.write(message, timeout=GUARD)
        results = [child.result() for child in children]

        assert segment_exists(writer.handle)  # readers exiting did not unlink it
        assert writer.overflowed > 0
    expected = [digest(m) for m in messages]
    for result in results:
        assert result["digests"] == expected
    assert not segment_exists(writer.handle)


def test_a_slow_reader_holds_the_writer_until_it_catches_up(
    ctx: zmq.Context, spawn: Callable[..., Child]
) -> None:
    messages = random_messages(2, 12, [10, 100])
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=1024, n_chunks=4) as writer:
        child = spawn(writer.handle, index=0, count=len(messages), delay_first=0.8)
        child.expect("ready")
        started = time.monotonic()
        for message in messages[:4]:
            writer.write(message, timeout=0)  # the ring has room for four
        fill = time.monotonic() - started
        writer.write(messages[4], timeout=GUARD)
        held = time.monotonic() - started
        for message in messages[5:]:
            writer.write(message, timeout=GUARD)
        result = child.result()

    assert fill < 0.2
    assert 0.5 < held < 5
    assert result["digests"] == [digest(m) for m in messages]


def test_a_remote_reader_gets_every_message_from_zmq(
    ctx: zmq.Context, spawn: Callable[..., Child]
) -> None:
    messages = random_messages(3, 60, [0, 5, 900, 9000])
    writer = ShmRingWriter(
        1, zmq_context=ctx, chunk_bytes=4096, n_chunks=2,
        overflow_address="tcp://127.0.0.1:*", remote_readers=1,
    )  # fmt: skip
    with writer, ShmRingReader(writer.handle, 0, zmq_context=ctx) as local:
        child = spawn(writer.handle, index=0, count=len(messages), remote=True)
        child.expect("ready")
        writer.wait_for_subscribers(timeout=GUARD)
        local_digests = []
        for message in messages:
            writer.write(message, timeout=GUARD)
            local_digests.append(digest(local.read(timeout=GUARD)))
        result = child.result()

    expected = [digest(m) for m in messages]
    assert result["digests"] == expected
    assert local_digests == expected


def test_a_dead_reader_times_the_writer_out_until_marked_dead(
    ctx: zmq.Context, spawn: Callable[..., Child]
) -> None:
    messages = random_messages(4, 20, [1, 300])
    with ShmRingWriter(2, zmq_context=ctx, chunk_bytes=1024, n_chunks=4) as writer:
        doomed = spawn(writer.handle, index=0, count=len(messages))
        survivor = spawn(writer.handle, index=1, count=len(messages))
        doomed.expect("ready")
        survivor.expect("ready")
        os.kill(doomed.proc.pid, signal.SIGKILL)
        assert doomed.proc.wait(timeout=GUARD) == -signal.SIGKILL
        for message in messages[:4]:
            writer.write(message, timeout=GUARD)

        started = time.monotonic()
        with pytest.raises(RingTimeout) as excinfo:
            writer.write(messages[4], timeout=0.5)
        waited = time.monotonic() - started
        writer.mark_reader_dead(0)
        for message in messages[4:]:
            writer.write(message, timeout=GUARD)
        result = survivor.result()

    assert 0.5 <= waited < 2
    assert excinfo.value.waiting_on == (0,)
    assert result["digests"] == [digest(m) for m in messages]


def test_an_idle_reader_costs_no_cpu_and_wakes_within_milliseconds(
    ctx: zmq.Context, spawn: Callable[..., Child]
) -> None:
    # Idle times half a poll slice off the reader's polling schedule: a lost wake-up would
    # show as ~POLL_SLICE_S / 2 of latency, not hide behind a slice that happens to end.
    idle = [SLEEP_AFTER_S + (k + 0.5) * POLL_SLICE_S for k in (20, 2, 2, 2, 2, 2)]
    with ShmRingWriter(1, zmq_context=ctx) as writer:
        child = spawn(writer.handle, index=0, idle=idle)
        child.expect("ready")
        writer.wait_for_subscribers(timeout=GUARD)
        for seconds in idle:
            child.expect("reading")
            time.sleep(seconds)
            writer.write([struct.pack("d", time.monotonic())], timeout=GUARD)
        rounds = child.result()["rounds"]

    assert rounds[0]["cpu"] < 0.02, rounds  # a second blocked
    assert statistics.median(r["latency"] for r in rounds) < 0.01, rounds


def test_a_writer_that_cannot_bind_leaves_no_segment(
    ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[RingSegment] = []
    original = RingSegment.create

    def create(*args: int) -> RingSegment:
        created.append(original(*args))
        return created[-1]

    monkeypatch.setattr(RingSegment, "create", create)
    with pytest.raises(zmq.ZMQError):
        ShmRingWriter(1, zmq_context=ctx, chunk_bytes=256, n_chunks=2, overflow_address="no://")
    monkeypatch.undo()

    assert len(created) == 1
    assert not segment_exists(RingHandle(created[0].name, 1, 256, 2, "unused"))


def test_a_write_that_needs_zmq_waits_for_the_reader_to_subscribe(ctx: zmq.Context) -> None:
    with ShmRingWriter(1, zmq_context=ctx, chunk_bytes=256) as writer:
        big = [b"z" * 1000]
        with pytest.raises(RingTimeout):
            writer.wait_for_subscribers(timeout=0.05)
        with pytest.raises(RingTimeout):
            writer.write(big, timeout=0.05)
        with ShmRingReader(writer.handle, 0, zmq_context=ctx) as reader:
            writer.write(big, timeout=GUARD)
            writer.write([b"small"], timeout=GUARD)

            assert [bytes(f) for f in reader.read(timeout=GUARD)] == big  # the first message
            assert [bytes(f) for f in reader.read(timeout=GUARD)] == [b"small"]
            assert writer.overflowed == 1
