"""`triode bench serve`: an OpenAI-compatible server under load, measured from the client side.

Streams `POST /v1/completions` (`ignore_eos`, greedy, exactly `--output-len` tokens) for
`--num-prompts` synthetic prompts at `--max-concurrency` streams and, optionally, Poisson arrivals
at `--request-rate`, and reports request and token throughput, time to first token (TTFT), time
per output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency.

`--compare-offline` starts `triode serve` itself, measures it, stops it, and only then runs the
same workload through the engine in this process (`open_engine`, no HTTP), so the two never share
the CPUs; it prints both side by side with the cost of serving over the offline engine.

`completion_stream` times each stream, `serve_report` writes the tables and `server_process`
runs a launched server; the other benchmarks reuse this module's workload and client.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

from triode.actors import Engine, RequestError, SamplingParams, open_engine
from triode.wire.ports import free_port

from .completion_stream import RequestResult, stream_completion
from .serve_report import (
    TARGET_CONCURRENCY,
    format_comparison,
    format_report,
    json_safe,
    overhead_of,
)
from .server_process import open_server, serve_command

# Common words that BPE vocabularies hold as one token each (with their leading space), so a
# prompt of N words is about N tokens.
WORDS = """
the of and to in is was for on that with as by at from his her they this which or had not are
but have one all were when there been has more their time will would who so out up into can
said new like some could then them other than first only its also after two over these many
may well made year back before way water long little very just any where most through man day
good people state great three under high last such city house world part small school might
end still life while both home same work because found must between each old even place
""".split()
WARMUP_PROMPT = "Hello, my name is"


def synthetic_prompts(n: int, input_len: int, seed: int) -> list[str]:
    """`n` prompts of `input_len` words drawn from `WORDS` (about as many tokens), the same
    for the same seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=input_len)) for _ in range(n)]


def concurrency_list(
    parser: argparse.ArgumentParser, text: str, flag: str = "--concurrencies"
) -> list[int]:
    """`flag`'s comma-separated counts (stream counts, instance counts) as ints; the parser's
    error, which exits, for anything else."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        example = parser.get_default(flag.removeprefix("--").replace("-", "_"))
        parser.error(f"{flag} takes integers, e.g. {example}")
    if not counts or min(counts) < 1:
        parser.error(f"{flag} must be >= 1")
    return counts


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs over `duration` and the mean/median/p99 latencies, in milliseconds, of the
    successful requests; failed ones are only counted and their errors listed."""
    ok = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        for stat, value in _stats(values).items():
            summary[f"{stat}_{name}_ms"] = value * 1e3
    summary["errors"] = [r.error for r in results if not r.ok]
    return summary


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()),
        "median": float(np.percentile(array, 50)),
        "p99": float(np.percentile(array, 99)),
    }


async def _drive(
    prompts: Sequence[str],
    one: Callable[[str], Awaitable[RequestResult]],
    max_concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Run `one` on every prompt, at most `max_concurrency` at a time, arriving as a Poisson
    process of `request_rate` per second (all at once if infinite); the results and the time."""
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    limiter = trio.CapacityLimiter(max_concurrency)
    rng = random.Random(seed)
    results = [RequestResult() for _ in prompts]

    async def run(i: int, prompt: str) -> None:
        async with limiter:
            results[i] = await one(prompt)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(prompts):
            if i and math.isfinite(request_rate):
                await trio.sleep(rng.expovariate(request_rate))
            nursery.start_soon(run, i, prompt)
    return results, time.perf_counter() - start


# seconds an idle connection stays in the client's pool
KEEPALIVE_EXPIRY = 2.0


async def run_benchmark(
    base_url: str,
    *,
    model: str | Sequence[str] | None,
    prompts: list[str],
    output_len: int,
    max_concurrency: int,
    request_rate: float = math.inf,
    api_key: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Stream a completion for each prompt from the server at `base_url` and summarize.

    `model` None is the first model the server lists; a list of names (LoRA adapters beside the
    base) is taken in turn, request by request as they start. One short warm-up request per name
    goes first and is not measured. Returns `summarize`'s dict plus `base_url`, `model` and the
    per-request `requests`. Failed requests are counted, not raised; raises `RuntimeError` if a
    warm-up fails and `httpx.HTTPError` if the server cannot be reached. Cancelling it abandons the
    requests in flight (the server sees the connections close)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # An idle connection is dropped here well before servers drop it (uvicorn and hypercorn
    # after 5 s, httpx's own default too): reusing one as the server closes it fails the request.
    limits = httpx.Limits(
        max_connections=max_concurrency + 1,
        max_keepalive_connections=None,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    timeout = httpx.Timeout(30.0, read=None, pool=None)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        if model is None:
            model = await first_model_id(client)
        names = [model] if isinstance(model, str) else list(model)
        turn = itertools.cycle(names)

        def one(prompt: str, max_tokens: int = output_len) -> Awaitable[RequestResult]:
            body = {
                "model": next(turn),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return stream_completion(client, body)

        for _ in names:
            warmup = await one(WARMUP_PROMPT, min(output_len, 4))
            if not warmup.ok:
                raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        results, duration = await _drive(prompts, one, max_concurrency, request_rate, seed)
    summary = summarize(results, duration)
    return {
        "base_url": base_url,
        "model": model,
        **summary,
        "requests": [asdict(r) for r in results],
    }


async def first_model_id(client: httpx.AsyncClient) -> str:
    """The first id `GET /v1/models` lists. Raises `httpx.HTTPStatusError` on an error status."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_offline(
    model: str | None,
    *,
    prompts: list[str],
    output_len: int,
    max_concurrency: int,
    request_rate: float = math.inf,
    seed: int = 0,
    **engine_args: Any,
) -> dict[str, Any]:
    """The same workload as `run_benchmark`, through `open_engine(model, **engine_args)` in
    this process: the engine without HTTP. Returns the same dict, with the model directory as
    `model` and no `base_url`; raises what `open_engine` raises."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    async with open_engine(model, **engine_args) as engine:
        warmup = SamplingParams(max_tokens=min(output_len, 4), temperature=0, ignore_eos=True)
        if not (result := await _generate(engine, WARMUP_PROMPT, warmup)).ok:
            raise RuntimeError(f"the warm-up request failed: {result.error}")
        one = partial(_generate, engine, params=params)
        results, duration = await _drive(prompts, one, max_concurrency, request_rate, seed)
        summary = summarize(results, duration)
        return {"model": str(engine.model_dir), **summary, "requests": [asdict(r) for r in results]}


async def _generate(engine: Engine, prompt: str, params: SamplingParams) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async for out in engine.generate(prompt, params):
            now = time.perf_counter()
            result.prompt_tokens = len(out.prompt_token_ids)
            tokens = len(out.outputs[0].token_ids)
            new = tokens - result.output_tokens
            if new > 0:
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itl.extend([(now - last) / new] * new)
                last = now
                result.output_tokens = tokens
    except RequestError as e:
        result.error = f"RequestError: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with `launch` (whether to start a server) and `launch_model` (its model,
    None for the default one) worked out from `--launch`, `--tiny` and `--compare-offline`."""
    parser = argparse.ArgumentParser(
        prog="triode bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", help="the server to measure (http://127.0.0.1:8000)")
    parser.add_argument("--model", help="the served model name (the first of GET /v1/models)")
    parser.add_argument(
        "--api-key", default=os.environ.get("TRIODE_API_KEY"), help="(default: TRIODE_API_KEY)"
    )
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=TARGET_CONCURRENCY)
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument(
        "--launch",
        nargs="?",
        const="",
        metavar="MODEL",
        help="start `triode serve MODEL` (no MODEL: the default model) and measure it",
    )
    parser.add_argument("--tiny", action="store_true", help="short for --launch tiny-random")
    parser.add_argument(
        "--compare-offline",
        action="store_true",
        help="then run the same workload through the engine without HTTP (launches a server)",
    )
    parser.add_argument("--dtype", help="for the launched server and the offline engine")
    parser.add_argument("--max-num-seqs", type=int, help="likewise")
    args = parser.parse_args(argv)

    if args.tiny:
        if args.launch is not None:
            parser.error("--tiny is --launch tiny-random: give one of them")
        args.launch = "tiny-random"
    if args.compare_offline and args.launch is None:
        args.launch = ""
    if args.launch is not None and args.base_url is not None:
        parser.error("--base-url measures a running server; --launch starts one")
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0")
    args.launch_model = args.launch or None
    args.launch = args.launch is not None
    if not args.launch:
        args.base_url = args.base_url or "http://127.0.0.1:8000"
    return args


async def _measure_serving(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    measure = partial(run_benchmark, model=args.model, api_key=args.api_key, **workload)
    if not args.launch:
        return await measure(args.base_url)
    port = free_port()
    command = serve_command(
        args.launch_model, port, dtype=args.dtype, max_num_seqs=args.max_num_seqs
    )
    print(f"starting {' '.join(command[1:])}", file=sys.stderr)
    base_url = f"http://127.0.0.1:{port}"
    async with open_server(command, base_url) as server:
        before = _cpu_seconds(server.pid)
        result = await measure(base_url)
        after = _cpu_seconds(server.pid)
    # CPU time of the edge process alone (HTTP, SSE, detokenization, ZMQ) and of the engine
    edge, engine = (b - a for a, b in zip(before, after, strict=True))
    result["edge_cpu_s"], result["engine_cpu_s"] = edge, engine
    result["output_tokens_per_edge_cpu_s"] = result["total_output_tokens"] / edge if edge else 0
    return result


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """(user + system CPU seconds of `pid`, of its child processes), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(p: int | str) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    children = [c for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]  # fmt: skip
    return of(pid), sum(of(c) for c in children)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload: dict[str, Any] = {
        "prompts": synthetic_prompts(args.num_prompts, args.input_len, args.seed),
        "output_len": args.output_len,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "seed": args.seed,
    }
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "json")}
    report: dict[str, Any] = {"config": {**config, "json": str(args.json)}}
    report["serving"] = serving = trio.run(_measure_serving, args, workload)
    print(format_report(serving))
    if args.compare_offline:
        engine_args = {
            k: v for k in ("dtype", "max_num_seqs") if (v := getattr(args, k)) is not None
        }
        offline = trio.run(partial(run_offline, args.launch_model, **workload, **engine_args))
        print(format_report(offline, "Offline engine"))
        print(format_comparison(serving, offline, args.max_concurrency))
        ratio, overhead = overhead_of(serving, offline)
        report.update(offline=offline, ratio=ratio, overhead_pct=overhead)
    if args.json:
        args.json.write_text(json.dumps(json_safe(report), indent=2))


if __name__ == "__main__":
    main()
