"""`triode bench lora`: what serving LoRA adapters costs, against the base model, in one run.

Writes `--adapters` random PEFT adapters (rank `--rank`, every projection of every layer) for the
model, starts one `triode serve --enable-lora` with all of them loaded (`--max-loras` as many), and
at each of `--concurrencies` streams the same workload (`bench serve`'s: greedy completions of
exactly `--output-len` tokens, `ignore_eos`) three ways: every request on the base model, every
request on one adapter, and requests taking the adapters in turn (mixed in every step). Prints
output tok/s and median TPOT for each, and each adapter load's ratio to the base's. The loads share
one server and take turns in `--rounds` rounds at each concurrency (base, one, mixed, base, ...),
each round its own prompts; a ratio is the median of the rounds' ratios, so that a shared machine's
drift over minutes, which moves all three alike within a round, drops out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from triode.wire.ports import free_port

from .frontend import cpu_model, model_dir
from .serve import concurrency_list, run_benchmark, synthetic_prompts
from .server_process import open_server, serve_command

BASE = "base"
LOADS = ("base", "one adapter", "mixed adapters")


async def measure(args: argparse.Namespace, adapters: dict[str, Path]) -> list[dict[str, Any]]:
    """One server with every adapter; each load at each concurrency, a row each."""
    port = free_port()
    command = serve_command(args.model, port, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    command += ["--served-model-name", BASE, "--enable-lora", "--max-loras", str(len(adapters))]
    command += ["--max-lora-rank", str(args.rank), "--lora-modules"]
    command += [f"{name}={path}" for name, path in adapters.items()]
    base_url = f"http://127.0.0.1:{port}"
    names = list(adapters)
    models: dict[str, str | list[str]] = {
        "base": BASE,
        "one adapter": names[0],
        "mixed adapters": names,
    }
    rows = []
    async with open_server(command, base_url, ready_timeout=600.0):
        for concurrency in args.concurrency_list:
            count = max(args.min_prompts, args.prompts_per_stream * concurrency)
            for round_ in range(args.rounds):
                prompts = synthetic_prompts(
                    count, args.input_len, args.seed + 1000 * round_ + concurrency
                )
                for load in LOADS:
                    print(
                        f"round {round_ + 1}/{args.rounds}, {load}: {count} requests at "
                        f"{concurrency}",
                        file=sys.stderr,
                    )
                    result = await run_benchmark(
                        base_url,
                        model=models[load],
                        prompts=prompts,
                        output_len=args.output_len,
                        max_concurrency=concurrency,
                    )
                    result.pop("requests")
                    result.update(load=load, concurrency=concurrency, round=round_)
                    rows.append(result)
    return rows


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"LoRA against the base model: {Path(args.model or 'default model').name}, "
        f"{args.adapters} adapters of rank {args.rank} on all projections, "
        f"{args.output_len} output tokens per request, dtype {args.dtype or 'auto'}, "
        f"{args.rounds} rounds; ratios are the median of the rounds'",
        "",
        "| streams | base tok/s | one adapter tok/s | ratio | mixed tok/s | ratio "
        "| TPOT p50 ms (base / one / mixed) | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in args.concurrency_list:
        mine = [r for r in rows if r["concurrency"] == c]
        by = {load: [r for r in mine if r["load"] == load] for load in LOADS}
        if not all(by.values()):
            continue
        rate = {load: _rate(by[load]) for load in LOADS}
        tpot = " / ".join(
            f"{statistics.median(r['median_tpot_ms'] for r in by[load]):.1f}" for load in LOADS
        )
        failed = sum(r["failed"] for r in mine)
        one, mixed = (_median_ratio(by[load], by["base"]) for load in LOADS[1:])
        lines.append(
            f"| {c} | {rate['base']:,.1f} | {rate['one adapter']:,.1f} | {one} | "
            f"{rate['mixed adapters']:,.1f} | {mixed} | {tpot} | {failed} |"
        )
    lines.append(f"CPUs: {len(os.sched_getaffinity(0))} ({cpu_model()})")
    return "\n".join(lines)


def _rate(rows: list[dict[str, Any]]) -> float:
    """Output tokens per second over all of a load's rounds."""
    seconds = sum(r["duration_s"] for r in rows)
    return sum(r["total_output_tokens"] for r in rows) / seconds if seconds else 0.0


def _median_ratio(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    """The median over rounds of a load's output rate over the base's in the same round."""
    by_round = {r["round"]: r["output_throughput"] for r in base}
    ratios = [
        r["output_throughput"] / by_round[r["round"]] for r in rows if by_round.get(r["round"])
    ]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="the base model (default: the default model)")
    parser.add_argument("--dtype", help="the server's --dtype (default: its own, auto)")
    parser.add_argument("--adapters", type=int, default=4, help="adapters in the mixed load")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrencies", default="1,8,32", help="comma-separated")
    parser.add_argument("--prompts-per-stream", type=int, default=1, help="per round")
    parser.add_argument("--min-prompts", type=int, default=4, help="per round")
    parser.add_argument("--input-len", type=int, default=36, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="turns of the three loads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    args.concurrency_list = concurrency_list(parser, args.concurrencies)
    if min(args.adapters, args.rank, args.rounds) < 1:
        parser.error("--adapters, --rank and --rounds must be >= 1")
    return args


def random_adapter(model: Path, out: Path, *, rank: int, seed: int) -> Path:
    """A random PEFT adapter for `model` at `out`, written by the model process's side of
    triode (`triode.gpu.lora.random_adapter`), which the edge does not import."""
    command = [sys.executable, "-m", "triode.gpu.lora.random_adapter", str(model), str(out)]
    subprocess.run([*command, "--rank", str(rank), "--seed", str(seed)], check=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base_dir = model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="triode-lora-bench-") as scratch:
        adapters = {
            f"adapter-{i}": random_adapter(
                base_dir, Path(scratch) / f"adapter-{i}", rank=args.rank, seed=args.seed + i
            )
            for i in range(args.adapters)
        }
        rows = trio.run(measure, args, adapters)
    print(format_table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
