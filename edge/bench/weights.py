"""`triode bench weights`: what new weights and sleep cost a running server, in one run.

For the default model and a larger random-weight one (about 1 GB in fp32, built once under the
output directory), each served by `triode serve --enable-admin-api`:

- cold start: from `triode serve` to the first 200 of /health, the baseline every other row is
  measured against (a restart is what a server without these operations needs);
- sleep at levels 1 and 2 and the wakes: how long each call took, and the resident memory of the
  server's whole process tree (API server, engine core, workers) after it;
- new weights: `/update_weights_from_disk` from the model's own directory, and a trainer process
  (`triode.gpu.bench.weight_push`) pushing every tensor with `WeightSyncClient` over `shm` and
  over `broadcast` (the push alone is timed, not the trainer's reading of the checkpoint);
- and that greedy outputs after all of it are those of before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from triode.wire.ports import free_port

from .server_process import open_server, serve_command

PUSH = "triode.gpu.bench.weight_push"
PROMPT = "The capital of France is"
MiB = 1 << 20


def tree_rss(root: int) -> int:
    """The resident memory of `root` and every process descended from it (the server, its
    engine cores, their workers), in bytes."""
    parent_of: dict[int, int] = {}
    rss_of: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parent_of[pid], rss_of[pid] = int(fields[1]), int(fields[21]) * page
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parent_of.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(rss_of.get(pid, 0) for pid in tree)


async def _greedy(client: httpx.AsyncClient) -> list[int]:
    answer = await client.post(
        "/v1/completions",
        json={
            "model": (await client.get("/v1/models")).json()["data"][0]["id"],
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["token_ids"])


async def _timed(client: httpx.AsyncClient, path: str, **kwargs: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    answer = await client.post(path, **kwargs)
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"{path}: {answer.status_code} {answer.text}")
    return seconds, answer.json()


async def _push(url: str, directory: str, backend: str) -> dict[str, Any]:
    command = [sys.executable, "-m", PUSH, "push", url, directory, "--backend", backend]
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {backend} push failed:\n{done.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


async def bench_model(model: str | None, kv_cache_memory: str) -> dict[str, Any]:
    """Every row for one model: (what, seconds, resident MiB after)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(model, port, dtype="float32")
    command += ["--enable-admin-api", "--kv-cache-memory", kv_cache_memory]
    rows: list[tuple[str, float, float]] = []
    started = time.perf_counter()
    async with open_server(command, url) as server:
        cold = time.perf_counter() - started
        rss = lambda: tree_rss(server.pid) / MiB  # noqa: E731 - read after each call
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            directory = (await client.get("/v1/models")).json()["data"][0]["root"]
            before = await _greedy(client)
            rows.append(("cold start (baseline)", cold, rss()))
            for what, path, params in (
                ("sleep level 1", "/sleep", {"level": 1}),
                ("wake", "/wake_up", {}),
                ("sleep level 2", "/sleep", {"level": 2}),
                ("wake (weights reloaded)", "/wake_up", {}),
            ):
                seconds, _ = await _timed(client, path, params=params)
                rows.append((what, seconds, rss()))
            seconds, _ = await _timed(
                client, "/update_weights_from_disk", json={"model_path": directory}
            )
            rows.append(("weights from disk", seconds, rss()))
            pushes = {}
            for backend in ("shm", "broadcast"):
                pushes[backend] = await _push(url, directory, backend)
                rows.append((f"weights pushed, {backend}", pushes[backend]["seconds"], rss()))
            after = await _greedy(client)
    return {
        "model": model or "default",
        "directory": directory,
        "bytes": pushes["shm"]["bytes"],
        "rows": rows,
        "same_outputs": before == after,
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        cold = result["rows"][0][1]
        lines.append(
            f"\n{result['model']} ({result['bytes'] / MiB:.0f} MiB of weights; greedy outputs "
            f"{'unchanged' if result['same_outputs'] else 'CHANGED'} after all of it)"
        )
        lines.append(f"  {'':<28}{'seconds':>9}{'vs cold':>9}{'RSS MiB':>10}")
        for what, seconds, rss in result["rows"]:
            lines.append(f"  {what:<28}{seconds:>9.2f}{seconds / cold:>8.2f}x{rss:>10.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="triode bench weights", description=__doc__)
    parser.add_argument(
        "--large", type=Path, help="the large model's directory (default: built under a temp dir)"
    )
    parser.add_argument("--skip-large", action="store_true", help="the default model only")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    async def run() -> list[dict[str, Any]]:
        results = [await bench_model(None, args.kv_cache_memory)]
        if not args.skip_large:
            with tempfile.TemporaryDirectory(prefix="triode-bench-weights-") as tmp:
                large = args.large or Path(tmp) / "large"
                if not large.is_dir():
                    await trio.run_process([sys.executable, "-m", PUSH, "build", str(large)])
                results.append(await bench_model(str(large), args.kv_cache_memory))
        return results

    results = trio.run(run)
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
