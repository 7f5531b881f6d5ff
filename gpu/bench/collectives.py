"""What tensor and pipeline parallelism's exchanges cost on this CPU: `triode bench collectives`.

Two gloo ranks in two processes on this machine, one torch thread each, measure latency p50 and
p99 in µs of what the parallel engine sends:

- all_reduce of a [tokens, 576] hidden state (float32 and bfloat16; 1 and 64 tokens): the
  row-parallel linear layers' sum, twice a layer under tensor parallelism.
- the same sums through `shm_allreduce.ShmAllReduce`, which replaces gloo's for them when a
  tensor-parallel group's ranks share a host.
- send/recv of a hidden state and its float32 residual, 1 and 64 tokens: what one pipeline
  stage hands the next.
- all_gather of a [tokens, 49152 / 2] float32 logit shard: the vocabulary-parallel logits.
- a 64-sequence SchedulerOutput sent from rank 0 to rank 1: broadcast_object_list (pickle) against
  a plain ZMQ PUB/SUB of triode.wire's msgpack frames, decoded on arrival in both cases.

all_reduce and all_gather time back-to-back calls on rank 0 (every call waits for both ranks, so
they run in lockstep). The others are one way: half of rank 0's round trip to rank 1 and back, as
a one-way time needs clocks that agree.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from triode.wire import Buffer, Decoder, Encoder, ScheduledRequest, SchedulerOutput
from triode.wire.bench import percentile
from triode.wire.shm_ring import RingHandle, ShmRingReader, ShmRingWriter

from ..local_group import Rank, run_ranks
from ..object_collectives import all_gather
from ..shm_allreduce import ShmAllReduce

HIDDEN = 576  # the default model's hidden size
TOKENS = (1, 64)
VOCAB_SHARD = 49152 // 2  # the default model's vocabulary over 2 ranks
NUM_SEQS = 64
DTYPES = (torch.float32, torch.bfloat16)
WORLD = 2
TIMEOUT = 600.0
SHM_RING_OP = "ShmRingWriter -> ShmRingReader"
SHM_ALL_REDUCE_OP = "shm all_reduce"
SHM_MAX_BYTES = 1 << 20  # parallel_state's default limit


@dataclass(frozen=True)
class Row:
    op: str
    payload: str
    p50_us: float
    p99_us: float


# What rank 0 returns: op, payload, samples in µs (one way where the op is one way).
_Samples = list[tuple[str, str, list[float]]]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="triode bench collectives", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--iterations", type=int, default=1000, help="timed calls per row")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    print(f"CPU: {cpu_model()}")
    print(f"torch {torch.__version__}; gloo, world {WORLD}: two processes, 1 torch thread each")
    print()
    start = time.perf_counter()
    rows = run(args.iterations)
    print(format_table(rows))
    print()
    for note in notes(args.iterations):
        print(note)
    print(f"ran in {time.perf_counter() - start:.1f} s")


def run(iterations: int) -> list[Row]:
    """Every row, in table order, measured on two fresh gloo ranks."""
    with tempfile.TemporaryDirectory(prefix="triode-bench-collectives-") as ipc_dir:
        per_rank = run_ranks(
            _bench_rank,
            iterations,
            ipc_dir,
            backend="gloo",
            world=WORLD,
            threads=1,
            timeout=TIMEOUT,
        )
    samples: _Samples = per_rank[0]
    return [Row(op, payload, percentile(s, 50), percentile(s, 99)) for op, payload, s in samples]


def notes(iterations: int) -> list[str]:
    msg = scheduler_output()
    wire_bytes = sum(len(frame) for frame in Encoder().encode(msg))
    return [
        f"{iterations} timed calls a row after {_warmup(iterations)} untimed; one way: half a "
        "round trip rank 0 -> rank 1 -> rank 0",
        f"SchedulerOutput: {NUM_SEQS} sequences of 1 token and 14 blocks; msgpack "
        f"{wire_bytes} B, pickle {len(pickle.dumps(msg))} B; ZMQ over ipc://",
    ]


def scheduler_output() -> SchedulerOutput:
    """A decode step of `NUM_SEQS` sequences: what the driver broadcasts to its workers."""
    rng = random.Random(0)  # the same ids in every process, which the receivers check
    requests = [
        ScheduledRequest(
            request_id=uuid.UUID(int=rng.getrandbits(128), version=4).hex,
            token_ids=[1],
            num_computed_tokens=200,
            block_ids=list(range(14)),
        )
        for _ in range(NUM_SEQS)
    ]
    return SchedulerOutput(step=1, requests=requests)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def format_table(rows: Sequence[Row]) -> str:
    lines = ["| operation | payload | p50 µs | p99 µs |", "|---|---|---:|---:|"]
    lines += [f"| {r.op} | {r.payload} | {r.p50_us:,.1f} | {r.p99_us:,.1f} |" for r in rows]
    return "\n".join(lines)


# The ranks


def _bench_rank(me: Rank, iterations: int, ipc_dir: str) -> _Samples:
    rows: _Samples = []

    def measure(op: str, payload: str, call: Callable[[], object], *, one_way: bool) -> None:
        samples = _time(call, iterations)
        rows.append((op, payload, [s / 2 for s in samples] if one_way else samples))

    for dtype in DTYPES:
        for tokens in TOKENS:
            x = torch.zeros(tokens, HIDDEN, dtype=dtype)
            payload = f"[{tokens}, {HIDDEN}] {_name(dtype)}"
            measure("all_reduce", payload, functools.partial(dist.all_reduce, x), one_way=False)
    with ShmAllReduce.create(dist.group.WORLD, max_bytes=SHM_MAX_BYTES, timeout=TIMEOUT) as shm:
        for dtype in DTYPES:
            for tokens in TOKENS:
                x = torch.zeros(tokens, HIDDEN, dtype=dtype)
                payload = f"[{tokens}, {HIDDEN}] {_name(dtype)}"
                measure(
                    SHM_ALL_REDUCE_OP, payload, functools.partial(shm.all_reduce, x), one_way=False
                )
    for dtype in DTYPES:
        for tokens in TOKENS:
            pair = [torch.zeros(tokens, HIDDEN, dtype=dtype), torch.zeros(tokens, HIDDEN)]
            payload = f"[{tokens}, {HIDDEN}] {_name(dtype)} hidden + float32 residual"
            call = functools.partial(_tensors_there_and_back, me, pair)
            measure("send/recv", payload, call, one_way=True)
    for tokens in TOKENS:
        shard = torch.zeros(tokens, VOCAB_SHARD)
        gathered = [torch.empty_like(shard) for _ in range(me.world)]
        payload = f"[{tokens}, {VOCAB_SHARD}] float32 shard"
        call = functools.partial(dist.all_gather, gathered, shard)
        measure("all_gather", payload, call, one_way=False)
    msg = scheduler_output()
    payload = f"SchedulerOutput, {NUM_SEQS} sequences"
    call = functools.partial(_object_there_and_back, me, msg)
    measure("broadcast_object_list", payload, call, one_way=True)
    with _zmq_pair(me, ipc_dir) as (pub, sub):
        send = functools.partial(pub.send_multipart, copy=False)
        receive = functools.partial(sub.recv_multipart, copy=False)
        call = functools.partial(_frames_there_and_back, me, msg, send, receive)
        measure("ZMQ PUB/SUB", f"{payload}, msgpack", call, one_way=True)
    with _shm_ring_pair(me) as (writer, reader):
        call = functools.partial(_frames_there_and_back, me, msg, writer.write, reader.read)
        measure(SHM_RING_OP, f"{payload}, msgpack", call, one_way=True)
    return rows if me.rank == 0 else []


def _warmup(iterations: int) -> int:
    return max(5, iterations // 10)


def _time(call: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(_warmup(iterations)):
        call()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def _tensors_there_and_back(me: Rank, tensors: list[torch.Tensor]) -> None:
    peer = 1 - me.rank
    order = [dist.send, dist.recv] if me.rank == 0 else [dist.recv, dist.send]
    for transfer in order:
        for t in tensors:
            transfer(t, peer)


def _object_there_and_back(me: Rank, msg: SchedulerOutput) -> None:
    box: list[object] = [msg if me.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] != msg:
        raise RuntimeError(f"rank {me.rank} received {box[0]!r}")
    dist.broadcast_object_list(box, src=1)


def _frames_there_and_back(
    me: Rank,
    msg: SchedulerOutput,
    send: Callable[[list[Buffer]], object],
    receive: Callable[[], Sequence[Any]],
) -> None:
    encoder, decoder = _codec()
    if me.rank == 0:
        send(encoder.encode(msg))
        decoder.decode(receive())
    else:
        received = decoder.decode(receive())
        if received != msg:
            raise RuntimeError(f"rank 1 received {received!r}")
        send(encoder.encode(received))


@functools.cache
def _codec() -> tuple[Encoder, Decoder[SchedulerOutput]]:
    # One of each per process, reused, as a worker would.
    return Encoder(), Decoder(SchedulerOutput)


@contextmanager
def _zmq_pair(me: Rank, ipc_dir: str) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """Each rank's PUB (bound) and SUB (connected to the other's), proven connected both ways.

    A SUB drops what was published before its subscription reached the PUB, so rank 0 probes
    until one comes back, then both pass a final b"go" that every earlier probe precedes.
    """
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        for sock in (pub, sub):
            sock.setsockopt(zmq.LINGER, 0)
        pub.bind(f"ipc://{Path(ipc_dir, f'pub-{me.rank}')}")
        sub.connect(f"ipc://{Path(ipc_dir, f'pub-{1 - me.rank}')}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if me.rank == 0:
            while True:
                pub.send(b"probe")
                if sub.poll(10):
                    break
            pub.send(b"go")
            while sub.recv() != b"go":
                pass
        else:
            while sub.recv() != b"go":
                pub.send(b"probe")
            pub.send(b"go")
        yield pub, sub
    finally:
        pub.close()
        sub.close()
        ctx.term()


@contextmanager
def _shm_ring_pair(me: Rank) -> Iterator[tuple[Any, Any]]:
    """This rank's ring writer (the other rank its one reader) and its reader of the other's."""
    ctx = zmq.Context()
    try:
        with ShmRingWriter(1, zmq_context=ctx) as writer:
            handles = all_gather(writer.handle, RingHandle)
            with ShmRingReader(handles[1 - me.rank], 0, zmq_context=ctx) as reader:
                writer.wait_for_subscribers(timeout=30)
                yield writer, reader
                # The other rank's reader is done before this writer unlinks the segment.
                dist.barrier()
    finally:
        ctx.term()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    main(sys.argv[1:])
