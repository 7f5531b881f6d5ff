"""`triode bench ab`: what a change costs in serving, against a baseline checkout, in one run.

Starts `triode serve` twice with the same model and flags, once from this tree and once from
`--baseline DIR` (a checkout of another revision: `git worktree add --detach DIR REV`), and
streams `triode bench serve`'s workload (`POST /v1/completions`, greedy, `ignore_eos`) at each
`--concurrency`. Each round measures both servers at every concurrency, one at a time (the other
idles), in an order that alternates from round to round, so that a drift of the machine falls on
both alike; each round draws fresh prompts, the same for both. Reports, per concurrency, each
side's median output tokens/s and TTFT over the rounds, its noise (the spread of its rounds,
(max - min) / median), and the change from the baseline.

The baseline runs its own source with this interpreter and its packages: its package folders
are linked under a temporary `triode/` that goes first on PYTHONPATH, ahead of this tree's
editable install, and a child process checks that it imports them before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from triode.wire.ports import free_port

from .serve import run_benchmark, synthetic_prompts
from .server_process import open_server, serve_command

PACKAGES = ("wire", "actors", "gpu", "edge", "fuzz")
SIDES = ("baseline", "current")
_WHERE = "import triode.edge.cli as m, triode.wire as w; print(m.__file__); print(w.__file__)"


def link_packages(checkout: Path, into: Path) -> Path:
    """A folder to put first on PYTHONPATH so that `triode.*` imports from `checkout`: `into`,
    with `triode/<package>` linked to each of the checkout's package folders. Raises
    `ValueError` for a folder that is not a triode checkout."""
    checkout = checkout.resolve()
    missing = [
        p for p in ("wire", "actors", "edge") if not (checkout / p / "__init__.py").is_file()
    ]
    if missing:
        raise ValueError(f"{checkout} is not a triode checkout: no {', '.join(missing)} package")
    root = into / "triode"
    root.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        if (checkout / package).is_dir():
            (root / package).symlink_to(checkout / package, target_is_directory=True)
    return into


def imported_from(env: Mapping[str, str]) -> list[Path]:
    """Where a child process with `env` imports `triode.edge.cli` and `triode.wire` from."""
    out = subprocess.run(
        [sys.executable, "-c", _WHERE], env=dict(env), capture_output=True, text=True, check=True
    ).stdout
    return [Path(line) for line in out.split()]


def check_source(env: Mapping[str, str], expected: Path) -> None:
    """Raise `RuntimeError` unless a child with `env` imports triode's packages from under
    `expected` (links followed)."""
    expected = expected.resolve()
    for path in imported_from(env):
        if not path.resolve().is_relative_to(expected):
            raise RuntimeError(f"a server would import {path}, not a module under {expected}")


def compare(rounds: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]]) -> list[dict]:
    """One row per concurrency from each side's per-round `run_benchmark` results: the median
    output tokens/s and mean TTFT over the rounds, the noise of each side ((max - min) / median
    of its rounds' tokens/s, in %), and the current side's change from the baseline, in %."""
    rows = []
    for concurrency in sorted(rounds["baseline"]):
        row: dict[str, Any] = {"concurrency": concurrency}
        for side in SIDES:
            results = rounds[side][concurrency]
            rates = [r["output_throughput"] for r in results]
            median = statistics.median(rates)
            row[f"{side}_tok_s"] = median
            row[f"{side}_noise_pct"] = 100 * (max(rates) - min(rates)) / median if median else 0
            row[f"{side}_ttft_ms"] = statistics.median(r["mean_ttft_ms"] for r in results)
            row[f"{side}_failed"] = sum(r["failed"] for r in results)
        base = row["baseline_tok_s"]
        row["change_pct"] = 100 * (row["current_tok_s"] - base) / base if base else 0.0
        rows.append(row)
    return rows


def format_rows(rows: Sequence[Mapping[str, Any]], rounds: int) -> str:
    head = f"{'streams':>7} {'side':>9} {'tok/s':>9} {'noise':>7} {'TTFT ms':>9} {'failed':>6}"
    lines = [f"{f' baseline vs current, median of {rounds} rounds ':=^52}", head]
    for row in rows:
        for side in SIDES:
            lines.append(
                f"{row['concurrency']:>7} {side:>9} {row[f'{side}_tok_s']:>9.1f} "
                f"{row[f'{side}_noise_pct']:>6.1f}% {row[f'{side}_ttft_ms']:>9.1f} "
                f"{row[f'{side}_failed']:>6}"
            )
        lines.append(f"{row['concurrency']:>7} {'change':>9} {row['change_pct']:>+8.1f}%")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--model", help="what both serve (default: the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prompts-per-stream", type=int, default=4, help="requests per stream and round"
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", help="both servers require it, and the client sends it")
    parser.add_argument(
        "--server-args", default="", help="more `triode serve` flags for both (one string)"
    )
    parser.add_argument(
        "--current-args", default="", help="flags for the current tree's server only"
    )
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args(argv)
    for name in ("rounds", "prompts_per_stream", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency must be >= 1")
    return args


def _command(args: argparse.Namespace, port: int, extra: str) -> list[str]:
    command = serve_command(args.model, port)
    if args.api_key:
        command += ["--api-key", args.api_key]
    return command + shlex.split(args.server_args) + shlex.split(extra)


def side_envs(links: Path) -> dict[str, dict[str, str]]:
    """Each server's environment: the baseline's imports from `links` first."""
    current = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {"baseline": {**current, "PYTHONPATH": str(links)}, "current": current}


async def run(args: argparse.Namespace, envs: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """Both servers up (baseline first), then the rounds; returns the report. Cancelling it
    stops both servers."""
    urls: dict[str, str] = {}
    results: dict[str, dict[int, list[dict[str, Any]]]] = {s: {} for s in SIDES}
    async with AsyncExitStack() as stack:
        for side in SIDES:
            port = free_port()
            urls[side] = f"http://127.0.0.1:{port}"
            extra = args.current_args if side == "current" else ""
            command = _command(args, port, extra)
            print(f"starting the {side} server: {shlex.join(command[1:])}", file=sys.stderr)
            server = open_server(command, urls[side], env=dict(envs[side]))
            await stack.enter_async_context(server)
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            for concurrency in args.concurrency:
                n = concurrency * args.prompts_per_stream
                prompts = synthetic_prompts(n, args.input_len, args.seed + round_)
                for side in order:
                    result = await run_benchmark(
                        urls[side],
                        model=None,
                        prompts=prompts,
                        output_len=args.output_len,
                        max_concurrency=concurrency,
                        api_key=args.api_key,
                        seed=args.seed,
                    )
                    del result["requests"]
                    results[side].setdefault(concurrency, []).append(result)
                    print(
                        f"round {round_ + 1} {side:>8} x{concurrency}: "
                        f"{result['output_throughput']:.1f} tok/s",
                        file=sys.stderr,
                    )
    return {"rows": compare(results), "results": results}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # a server's environment is this one plus its own: neither may inherit another's path
    os.environ.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="triode-ab-") as tmp:
        try:
            envs = side_envs(link_packages(args.baseline, Path(tmp)))
            check_source(envs["baseline"], args.baseline)
            check_source(envs["current"], Path(__file__).resolve().parents[1])
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"triode bench ab: {e}") from None
        report = trio.run(run, args, envs)
    print(format_rows(report["rows"], args.rounds))
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config.pop("api_key", None)
        args.json.write_text(json.dumps({"config": config, **report}, indent=2))


if __name__ == "__main__":
    main()
