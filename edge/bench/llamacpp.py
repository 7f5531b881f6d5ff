"""`triode bench llamacpp`: triode and llama.cpp on one GGUF file, one workload, one run.

Starts llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, run by
`--llamacpp PYTHON`, a virtual environment with `llama-cpp-python[server]`; by default
`$TRIODE_CACHE/llamacpp-venv`) on the GGUF file (`--model`, by default triode's default model
file), streams the workload at each of `--concurrencies`, stops it, then does the same with
`triode serve` on the same file. The two never share the CPUs. `--rounds R` repeats the pair R
times; the table holds each figure's median over the rounds and the median of the rounds' ratios,
so that a shared machine's drift over minutes, which moves both servers of a round alike, drops
out.

The workload is `bench serve`'s: greedy completions of exactly `--output-len` tokens. triode gets
it as `bench serve` sends it (`ignore_eos`). llama-cpp-python's server has no `ignore_eos`; it is
asked for `min_tokens` = `max_tokens` (its end-of-sequence token masked until then) and no
repetition penalty (its default is 1.1). Its stream carries no usage, so its tokens are counted
from the stream: one chunk per token, but for tokens that only together make a UTF-8 character.
The table's last lines give each server's tokens per request, which show that both did the same
work.

llama.cpp runs `--llamacpp-threads` threads, by default every CPU of this process's affinity.
They wait for each other at every step: on 2 CPUs with one busy with other work, 2 threads decoded
SmolLM2-135M at 3 tokens per second and 1 thread at 32, so on a shared machine fewer threads can
be llama.cpp's fairer figure.

llama-cpp-python's server runs one request at a time: at 8 streams the other seven wait in its
queue, so its TTFT grows with the streams and its tokens per second do not; triode batches them.

Prints one row per concurrency: output tokens per second (all streams together), each request's
decode speed (1 / TPOT), TTFT and TPOT medians, for each server, and triode's ratio to llama.cpp's
(TPOT's is the inverse of the decode speed's). Absolute figures move with the machine and the
hour; the ratios of one run are what compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import trio

from triode.wire.ports import free_port

from .completion_stream import RequestResult, stream_completion
from .frontend import cpu_model
from .serve import (
    KEEPALIVE_EXPIRY,
    WARMUP_PROMPT,
    _drive,
    concurrency_list,
    first_model_id,
    run_benchmark,
    summarize,
    synthetic_prompts,
)
from .server_process import open_server, serve_command

SERVERS = ("llamacpp", "triode")
LABELS = {"llamacpp": "llama.cpp", "triode": "triode"}

# llama-cpp-python's server with the `GET /health` that `open_server` waits for: it loads the
# model before it listens, so a server that answers at all is ready
LLAMACPP_SERVE = """
import runpy, sys
from llama_cpp.server.app import router
router.add_api_route("/health", lambda: {}, methods=["GET"])
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def triode_paths() -> tuple[Path, Path]:
    """triode's cache directory and its default GGUF file, as the model process's side of triode
    finds them (`$TRIODE_CACHE`, by default `~/.cache/triode`); the edge does not import it."""
    code = (
        "from triode.gpu.cache_paths import cache_dir, default_gguf; "
        "print(cache_dir()); print(default_gguf())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cache, gguf = done.stdout.split("\n")[:2]
    return Path(cache), Path(gguf)


def command_for(server: str, args: argparse.Namespace, port: int) -> list[str]:
    """The command line that starts `server` on `port`, serving `args.model`."""
    if server == "triode":
        return serve_command(str(args.model), port)
    threads = str(args.llamacpp_threads)
    return [args.llamacpp, "-c", LLAMACPP_SERVE, "--model", str(args.model),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
            "--n_threads", threads, "--n_threads_batch", threads,
            # by default a request arriving ends the one streaming, and each prints its timings
            "--interrupt_requests", "False", "--verbose", "False"]  # fmt: skip


def llamacpp_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """A greedy completion of exactly `output_len` tokens, as llama-cpp-python's server takes
    one (`min_tokens` in place of `ignore_eos`, the repetition penalty off as triode's is)."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "temperature": 0, "repeat_penalty": 1.0, "stream": True}  # fmt: skip


async def run_llamacpp(
    base_url: str, *, prompts: list[str], output_len: int, max_concurrency: int
) -> dict[str, Any]:
    """`run_benchmark`'s workload and summary for llama-cpp-python's server: every prompt
    streamed, `max_concurrency` at a time, after one unmeasured warm-up request. Raises
    `RuntimeError` if the warm-up fails and `httpx.HTTPError` if the server cannot be
    reached."""
    limits = httpx.Limits(
        max_connections=max_concurrency + 1,
        max_keepalive_connections=None,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    timeout = httpx.Timeout(30.0, read=None, pool=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        model = await first_model_id(client)

        def one(prompt: str, max_tokens: int = output_len) -> Awaitable[RequestResult]:
            return stream_completion(client, llamacpp_body(model, prompt, max_tokens), counted=True)

        warmup = await one(WARMUP_PROMPT, min(output_len, 4))
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        results, duration = await _drive(prompts, one, max_concurrency, math.inf, 0)
    return {"base_url": base_url, "model": model, **summarize(results, duration)}


async def measure(server: str, args: argparse.Namespace, round_: int) -> list[dict[str, Any]]:
    """`server` started once and measured at every concurrency; one row each."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    print(f"round {round_}: starting {server}", file=sys.stderr)
    started = time.perf_counter()
    rows = []
    async with open_server(command_for(server, args, port), base_url, ready_timeout=900.0):
        start_s = time.perf_counter() - started
        for concurrency in args.concurrency_list:
            prompts = synthetic_prompts(
                max(args.min_prompts, args.prompts_per_stream * concurrency),
                args.input_len,
                args.seed + concurrency,
            )
            print(f"{server}: {len(prompts)} requests at {concurrency} streams", file=sys.stderr)
            workload: dict[str, Any] = {
                "prompts": prompts,
                "output_len": args.output_len,
                "max_concurrency": concurrency,
            }
            if server == "triode":
                result = await run_benchmark(base_url, model=None, **workload)
                result.pop("requests")
            else:
                result = await run_llamacpp(base_url, **workload)
            result.update(server=server, concurrency=concurrency, round=round_, start_s=start_s)
            rows.append(result)
    return rows


def decode_speed(row: dict[str, Any]) -> float:
    """One request's tokens per second after its first: 1 / TPOT."""
    tpot = row["median_tpot_ms"]
    return 1000.0 / tpot if tpot > 0 else 0.0


def tokens_per_request(row: dict[str, Any]) -> float:
    return row["total_output_tokens"] / row["completed"] if row["completed"] else 0.0


FIGURES = {
    "tok/s": lambda r: r["output_throughput"],
    "decode tok/s": decode_speed,
    "TTFT p50 ms": lambda r: r["median_ttft_ms"],
    "TPOT p50 ms": lambda r: r["median_tpot_ms"],
}
RATIOS = ("tok/s", "decode tok/s", "TTFT p50 ms")


def summarize_rounds(rows: list[dict[str, Any]], concurrency: int) -> dict[str, Any] | None:
    """For one concurrency, each server's figures as medians over the rounds and triode's
    ratio to llama.cpp's as the median of the rounds' ratios; None unless both ran."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["concurrency"] == concurrency:
            rounds.setdefault(r["round"], {})[r["server"]] = r
    pairs = [pair for pair in rounds.values() if len(pair) == len(SERVERS)]
    if not pairs:
        return None
    cell: dict[str, Any] = {}
    for name, figure in FIGURES.items():
        for server in SERVERS:
            cell[server, name] = statistics.median(figure(p[server]) for p in pairs)
    for name in RATIOS:
        figure = FIGURES[name]
        cell["ratio", name] = statistics.median(
            figure(p["triode"]) / figure(p["llamacpp"]) if figure(p["llamacpp"]) else 0.0
            for p in pairs
        )
    for server in SERVERS:
        cell[server, "failed"] = sum(p[server]["failed"] for p in pairs)
        cell[server, "tokens"] = statistics.median(tokens_per_request(p[server]) for p in pairs)
    return cell


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rounds = len({r["round"] for r in rows})
    lines = [
        f"triode vs llama.cpp (llama-cpp-python's server): {Path(args.model).name}, "
        f"{args.output_len} output tokens per request, ~{args.input_len}-word prompts, "
        f"medians of {rounds} round(s)",
        "",
        "| streams | llama.cpp tok/s | triode tok/s | ratio | llama.cpp decode tok/s "
        "| triode decode tok/s | ratio | llama.cpp TTFT p50 ms | triode TTFT p50 ms | ratio "
        "| llama.cpp TPOT p50 ms | triode TPOT p50 ms | failed (llama.cpp/triode) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tokens = {server: [] for server in SERVERS}
    for c in args.concurrency_list:
        cell = summarize_rounds(rows, c)
        if cell is None:
            continue
        row = [str(c)]
        for name, spec in (("tok/s", ",.1f"), ("decode tok/s", ",.1f"), ("TTFT p50 ms", ",.0f")):
            row += [f"{cell['llamacpp', name]:{spec}}", f"{cell['triode', name]:{spec}}"]
            row.append(f"{cell['ratio', name]:.2f}x")
        row += [f"{cell['llamacpp', 'TPOT p50 ms']:,.1f}", f"{cell['triode', 'TPOT p50 ms']:,.1f}"]
        row.append(f"{cell['llamacpp', 'failed']}/{cell['triode', 'failed']}")
        lines.append("| " + " | ".join(row) + " |")
        for server in SERVERS:
            tokens[server].append(f"{cell[server, 'tokens']:.1f}")
    lines.append("")
    lines += [
        f"{LABELS[s]}: {', '.join(tokens[s])} tokens per request, start to ready "
        f"{statistics.median(r['start_s'] for r in rows if r['server'] == s):.0f} s"
        for s in SERVERS
        if tokens[s]
    ]
    lines.append(
        f"llama.cpp runs one request at a time (at N streams, N - 1 wait in its queue), "
        f"on {args.llamacpp_threads} thread(s)"
    )
    lines.append(f"CPUs: {len(os.sched_getaffinity(0))} ({cpu_model()})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench llamacpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--llamacpp",
        metavar="PYTHON",
        help="a Python with llama-cpp-python[server] (default: $TRIODE_CACHE/llamacpp-venv's)",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the default model's)")
    parser.add_argument(
        "--llamacpp-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="llama.cpp's threads (default: every CPU of this process's affinity); its threads "
        "wait for each other at every step, so on CPUs that others use too, fewer run faster",
    )
    parser.add_argument("--concurrencies", default="1,8", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="llama.cpp then triode, R times")
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=36, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every round's rows here")
    args = parser.parse_args(argv)
    args.concurrency_list = concurrency_list(parser, args.concurrencies)
    for name in ("rounds", "output_len", "input_len", "llamacpp_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.llamacpp is None or args.model is None:
        cache, gguf = triode_paths()
        args.llamacpp = args.llamacpp or str(cache / "llamacpp-venv" / "bin" / "python")
        args.model = args.model or gguf
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [
        row
        for round_ in range(args.rounds)
        for server in SERVERS
        for row in trio.run(measure, server, args, round_)
    ]
    print(format_table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
