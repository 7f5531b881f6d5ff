"""`triode bench moe`: a mixture-of-experts model of realistic proportions (1.3 B parameters,
14% active: `gpu.bench.moe_model`), offline and served, at one stream and at `--concurrency`,
against transformers' `generate` on the same checkpoint, and tensor parallelism with and without
expert parallelism against one rank, all in one run; float32.

The last lines say where the decode steps stand against this machine: at one stream, the
active weights' bytes read per second against its memory read rate; at many, the expert
products' FLOP/s against its matmul rate at an expert's shapes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from triode.actors import open_engine
from triode.wire.ports import free_port

from .serve import run_benchmark, run_offline, synthetic_prompts
from .server_process import open_server, serve_command
from .throughput import bench_hf

# (label, engine arguments) of the parallel layouts compared with one rank
LAYOUTS: dict[str, dict[str, Any]] = {
    "TP=2": {"tensor_parallel_size": 2},
    "TP=2 + EP": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


def checkpoint(out: Path | None) -> dict[str, Any]:
    """The benchmark's checkpoint (built once) with its parameter counts and the machine's
    rates, from the model side of triode, which the edge does not import."""
    command = [sys.executable, "-m", "triode.gpu.bench.moe_model", "--rates"]
    command += [] if out is None else ["--out", str(out)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _offline(model: str, prompts: list[str], output_len: int, streams: int, **engine):  # type: ignore[no-untyped-def]
    return await run_offline(
        model,
        prompts=prompts[:streams] * (1 if streams > 1 else 2),
        output_len=output_len,
        max_concurrency=streams,
        dtype="float32",
        **engine,
    )


async def _served(model: str, prompts: list[str], output_len: int, streams: list[int]) -> list:  # type: ignore[type-arg]
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    results = []
    async with open_server(serve_command(model, port, dtype="float32"), base_url):
        for n in streams:
            results.append(
                await run_benchmark(
                    base_url,
                    model=None,
                    prompts=prompts[:n] * (1 if n > 1 else 2),
                    output_len=output_len,
                    max_concurrency=n,
                )
            )
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = checkpoint(args.out)
    model = info["model"]
    streams = [1, args.concurrency]
    prompts = synthetic_prompts(args.concurrency, args.input_len, seed=0)
    rows: dict[str, list[float]] = {}

    async def ours() -> None:
        for label, engine in [("triode offline, 1 rank", {})] + [
            (f"triode offline, {name}", engine) for name, engine in LAYOUTS.items()
        ]:
            results = [
                await _offline(model, prompts, args.output_len, n, **engine) for n in streams
            ]
            rows[label] = [r["output_throughput"] for r in results]
            print(f"{label}: {rows[label]}", file=sys.stderr)
        served = await _served(model, prompts, args.output_len, streams)
        rows["triode served, 1 rank"] = [r["output_throughput"] for r in served]

    trio.run(ours)
    if not args.skip_transformers:

        async def encode() -> list[list[int]]:
            async with open_engine(model, dtype="float32", max_num_seqs=8) as engine:
                return [engine.encode(p) for p in prompts]

        ids = trio.run(encode)
        hf = bench_hf(model, "float32", ids, args.output_len, args.concurrency)
        rows["transformers generate"] = [hf["single_tok_s"], hf["batch_tok_s"]]
    return {"checkpoint": info, "streams": streams, "rows": rows}


def table(report: dict[str, Any]) -> str:
    info, streams, rows = report["checkpoint"], report["streams"], report["rows"]
    hf = rows.get("transformers generate")
    one = rows["triode offline, 1 rank"]
    head = " | ".join(
        f"{n} stream{'s' if n > 1 else ''} tok/s | vs HF | vs 1 rank" for n in streams
    )
    lines = [
        f"MoE: {info['total'] / 1e9:.2f} B parameters, {info['active'] / 1e9:.2f} B active "
        f"per token; float32; {Path(info['model']).name}",
        "",
        f"| run | {head} |",
        "|---|" + "---|---|---|" * len(streams),
    ]
    for label, values in rows.items():
        cells = []
        for i, value in enumerate(values):
            vs_hf = f"{value / hf[i]:.2f}x" if hf else "-"
            cells.append(f"{value:.1f} | {vs_hf} | {value / one[i]:.2f}x")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    # one stream reads every active weight once a token; many streams compute the experts
    single, many = one[0], one[-1]
    read = single * info["active"] * 4 / 1e9
    flops = many * 2 * info["active"] / 1e9
    lines += [
        "",
        f"one stream: {read:.1f} GB/s of active float32 weights read, against "
        f"{info['read_gb_s']:.1f} GB/s this machine reads ({read / info['read_gb_s']:.0%})",
        f"{streams[-1]} streams: {flops:.1f} GFLOP/s in the active products, against "
        f"{info['matmul_gflops']:.1f} GFLOP/s of an expert-shaped float32 matmul on "
        f"{streams[-1]} rows ({flops / info['matmul_gflops']:.0%})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="triode bench moe", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoint is built")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
