"""`triode bench frontend`: the front end alone, with 1, 2, 4 ... API server processes.

Starts `triode serve tiny-random --api-server-count N` for each N of `--api-server-counts`
(a random-weight two-layer model, so the engine costs next to nothing and the edges' HTTP, SSE,
detokenization and ZMQ are what is measured), streams the same workload (`bench serve`'s:
`--num-prompts` completions of `--output-len` tokens at `--max-concurrency` streams) and prints
one row per N: output tokens per second, TTFT, and the CPU seconds the edges, the engine and
this client spent, with output tokens per edge CPU-second. All rows come from one run, one
server at a time, so they compare with each other; the client shares the machine with the
server, and its CPU time is in the table for that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import trio

from .bench_serve import free_port, open_server, run_benchmark, serve_command, synthetic_prompts


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a `triode serve` process tree by role: `edge` (the
    serving process itself, or its API server processes and their supervisor) and `engine`
    (the engine cores and their workers)."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(p: int | str) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    def children(p: int | str) -> list[str]:
        return [c for t in Path(f"/proc/{p}/task").iterdir()
                for c in (t / "children").read_text().split()]  # fmt: skip

    roles = {"edge": of(pid), "engine": 0.0}
    for child in children(pid):
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        name = argv[6].decode() if len(argv) > 6 else ""
        role = "edge" if name.startswith("api-server") else "engine"
        roles[role] += of(child) + sum(of(c) for c in children(child))
    return roles


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(count: int, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    port = free_port()
    command = serve_command(args.model, port, max_num_seqs=args.max_num_seqs)
    command += ["--api-server-count", str(count)]
    print(f"starting {' '.join(command[3:])}", file=sys.stderr)
    base_url = f"http://127.0.0.1:{port}"
    async with open_server(command, base_url) as server:
        before, client_before = cpu_by_role(server.pid), _client_cpu()
        result = await run_benchmark(
            base_url,
            model=None,
            prompts=prompts,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
        )
        after, client_after = cpu_by_role(server.pid), _client_cpu()
    result.pop("requests")
    edge = after["edge"] - before["edge"]
    result.update(
        api_servers=count,
        edge_cpu_s=edge,
        engine_cpu_s=after["engine"] - before["engine"],
        client_cpu_s=client_after - client_before,
        output_tokens_per_edge_cpu_s=result["total_output_tokens"] / edge if edge else 0.0,
    )
    return result


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Front end: tiny-random, {args.num_prompts} requests x {args.output_len} tokens, "
        f"{args.max_concurrency} streams",
        "",
        "| API servers | output tok/s | vs 1 | TTFT p50 ms | edge CPU s | per edge | "
        "engine CPU s | client CPU s | tok per edge CPU-s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows[0]["output_throughput"] or 1.0
    for r in rows:
        lines.append(
            f"| {r['api_servers']} | {r['output_throughput']:,.0f} | "
            f"{r['output_throughput'] / base:.2f}x | {r['median_ttft_ms']:,.0f} | "
            f"{r['edge_cpu_s']:.1f} | {r['edge_cpu_s'] / r['api_servers']:.1f} | "
            f"{r['engine_cpu_s']:.1f} | {r['client_cpu_s']:.1f} | "
            f"{r['output_tokens_per_edge_cpu_s']:,.0f} | {r['failed']} |"
        )
    lines.append(f"\nCPUs: {len(os.sched_getaffinity(0))} ({_cpu_model()})")
    return "\n".join(lines)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench frontend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--api-server-counts", default="1,2,4", help="comma-separated")
    parser.add_argument("--model", default="tiny-random", help="the model the servers serve")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        args.counts = [int(c) for c in args.api_server_counts.split(",")]
    except ValueError:
        parser.error("--api-server-counts takes integers, e.g. 1,2,4")
    if not args.counts or min(args.counts) < 1:
        parser.error("--api-server-counts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = synthetic_prompts(args.num_prompts, args.input_len, args.seed)
    rows = [trio.run(measure, count, args, prompts) for count in args.counts]
    print(format_table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
