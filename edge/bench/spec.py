"""`triode bench spec`: speculative decoding against none, served, in one run.

Starts `triode serve` without speculation, measures it, stops it; then starts it with
`--speculative-config JSON` and measures it the same way; the two never share the CPUs. Each
measurement streams greedy `POST /v1/chat/completions` (temperature 0, at most `--max-tokens`
tokens, ending where the model ends) for two workloads (`spec_prompts`): grounded (tasks whose
answer copies the prompt's passage: where proposals from the prompt are accepted) and chat (plain
questions: where they mostly are not), at each of `--concurrency` streams, each cell its own
prompts.

Prints one row per workload and stream count: output tok/s and mean TPOT for each server and
their ratio (spec / none), and the speculating server's acceptance rate (accepted / proposed
tokens) and mean acceptance length (1 + accepted tokens per proposal) over the cell, from the
difference of its `/metrics` counters before and after it. Greedy speculation is exact, so the
two servers' texts are compared request by request and every difference is listed. An empty
`--speculative-config` starts the second server without speculation too: the ratios of such a
run are the bench's own noise.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from triode.wire.ports import free_port

from ..sse import SSEParser
from .completion_stream import RequestResult, _StreamTimer
from .frontend import cpu_model
from .serve import KEEPALIVE_EXPIRY, concurrency_list, first_model_id, summarize
from .serve_report import json_safe
from .server_process import open_server, serve_command
from .spec_prompts import Prompt, workload_prompts

SERVERS = ("none", "spec")
WORKLOADS = ("grounded", "chat")
DEFAULT_SPECULATIVE_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
# the speculating engine's counters (vLLM's names), as `GET /metrics` exposes them
DRAFT_TOKENS = "triode:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "triode:spec_decode_num_accepted_tokens"
DRAFTS = "triode:spec_decode_num_drafts"
COUNTERS = (DRAFT_TOKENS, ACCEPTED_TOKENS, DRAFTS)
WARMUP_MESSAGE = "Say hello."


class _Delta(msgspec.Struct):
    content: str | None = None


class _ChatChoice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)


class _ChatChunk(msgspec.Struct):
    choices: list[_ChatChoice] = msgspec.field(default_factory=list)


_decode_chat_chunk = msgspec.json.Decoder(_ChatChunk).decode


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[RequestResult, str]:
    """`POST /v1/chat/completions` with `body` (which asks for a stream with usage), timed as
    `stream_completion` times a completion, and the text of its one choice. Failures are
    returned in the result, never raised; cancelling it closes the stream."""
    timer = _StreamTimer()
    parser = SSEParser()
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                error = (await response.aread()).decode(errors="replace")
                return timer.fail(f"HTTP {response.status_code}: {error[:500]}"), ""
            async with aclosing(response.aiter_bytes()) as data:
                async for received in data:
                    for payload in parser.feed(received):
                        timer.take(payload)
                        if payload != b"[DONE]":
                            text += [
                                c.delta.content or "" for c in _decode_chat_chunk(payload).choices
                            ]
                    if timer.result.error:
                        return timer.result, "".join(text)
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        return timer.fail(f"{type(e).__name__}: {e}"), "".join(text)
    return timer.finish(), "".join(text)


def read_counters(exposition: str) -> dict[str, float]:
    """`COUNTERS` from a Prometheus exposition (a counter's samples are `<name>_total`), each
    summed over its labels; a counter the text lacks is left out."""
    found: dict[str, float] = {}
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters' growth from `before` to `after`, with the acceptance rate (accepted /
    proposed tokens) and the mean acceptance length (1 + accepted tokens per proposal); NaN
    where a counter is missing or nothing was proposed."""
    grown = {n: after[n] - before.get(n, 0.0) if n in after else math.nan for n in COUNTERS}
    draft, accepted, drafts = grown[DRAFT_TOKENS], grown[ACCEPTED_TOKENS], grown[DRAFTS]
    return {
        "draft_tokens": draft,
        "accepted_tokens": accepted,
        "drafts": drafts,
        "acceptance_rate": accepted / draft if draft > 0 else math.nan,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else math.nan,
    }


def cells(args: argparse.Namespace) -> list[tuple[str, int, list[Prompt]]]:
    """(workload, streams, its prompts) for every cell; within a workload each cell has prompts
    of its own (a suffix cache must not have seen them), the same for both servers."""
    plan = []
    for workload in args.workload_list:
        counts = [requests_per_cell(args, c) for c in args.concurrency_list]
        prompts = workload_prompts(workload, sum(counts), args.seed)
        for concurrency, count in zip(args.concurrency_list, counts, strict=True):
            plan.append((workload, concurrency, prompts[:count]))
            prompts = prompts[count:]
    return plan


def requests_per_cell(args: argparse.Namespace, concurrency: int) -> int:
    """`--requests-per-cell`, or by default twice the streams and at least 4."""
    return args.requests_per_cell or max(4, 2 * concurrency)


def server_command(server: str, args: argparse.Namespace, port: int) -> list[str]:
    """`triode serve` for `server`; "spec" with `--speculative-config` unless that is empty."""
    command = serve_command(args.model, port, max_num_seqs=args.max_num_seqs)
    if server == "spec" and args.speculative_config:
        command += ["--speculative-config", args.speculative_config]
    return command


async def measure(server: str, args: argparse.Namespace) -> dict[str, Any]:
    """`server` ("none" or "spec") started, measured on every cell, and stopped: its command,
    pid and one row per cell (`summarize`'s figures, the counters' growth, the texts).

    Raises what `open_server` raises when the server does not start, `RuntimeError` when the
    warm-up request fails and `httpx.HTTPError` when `/metrics` or `/v1/models` does; failed
    measured requests are counted, not raised. Cancelling it stops the server."""
    port = free_port()
    command = server_command(server, args, port)
    base_url = f"http://127.0.0.1:{port}"
    print(f"starting {server}: {shlex.join(command)}", file=sys.stderr)
    rows = []
    limits = httpx.Limits(
        max_connections=max(args.concurrency_list) + 1,
        max_keepalive_connections=None,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    timeout = httpx.Timeout(30.0, read=None, pool=None)
    async with (
        open_server(command, base_url, ready_timeout=600.0) as process,
        httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client,
    ):
        model = await first_model_id(client)

        def body(text: str, max_tokens: int) -> dict[str, Any]:
            return {"model": model, "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip

        warmup, _ = await stream_chat(client, body(WARMUP_MESSAGE, 4))
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
        for workload, concurrency, prompts in cells(args):
            print(
                f"{server}: {workload}, {len(prompts)} requests at {concurrency}", file=sys.stderr
            )
            before = await _counters(client)
            results, texts, duration = await _drive(
                [body(p.text, args.max_tokens) for p in prompts], client, concurrency
            )
            counted = acceptance(before, await _counters(client))
            failed = [i for i, r in enumerate(results) if not r.ok]
            rows.append({"server": server, "workload": workload, "concurrency": concurrency,
                         **summarize(results, duration), **counted, "texts": texts,
                         "failed_indices": failed})  # fmt: skip
    return {"server": server, "command": command, "pid": process.pid, "rows": rows}


async def _drive(
    bodies: list[dict[str, Any]], client: httpx.AsyncClient, concurrency: int
) -> tuple[list[RequestResult], list[str], float]:
    """Every body streamed, `concurrency` at a time: results, texts and the time it took."""
    limiter = trio.CapacityLimiter(concurrency)
    results = [RequestResult() for _ in bodies]
    texts = [""] * len(bodies)

    async def one(i: int) -> None:
        async with limiter:
            results[i], texts[i] = await stream_chat(client, bodies[i])

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return results, texts, time.perf_counter() - start


async def _counters(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    response.raise_for_status()
    return read_counters(response.text)


def differences(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The two servers' texts compared request by request: how many were compared (both
    succeeded), and each that differs as workload, streams, index and first differing
    character. Empty unless both servers ran."""
    by = {r["server"]: {(x["workload"], x["concurrency"]): x for x in r["rows"]} for r in runs}
    if set(by) != set(SERVERS):
        return {}
    compared, differ = 0, []
    for key, none in by["none"].items():
        spec = by["spec"].get(key)
        if spec is None:
            continue
        failed = set(none["failed_indices"]) | set(spec["failed_indices"])
        for i, (a, b) in enumerate(zip(none["texts"], spec["texts"], strict=True)):
            if i in failed:
                continue
            compared += 1
            if a != b:
                at = first_difference(a, b)
                differ.append({"workload": key[0], "concurrency": key[1], "index": i, "at": at})
    return {"compared": compared, "differ": differ}


def first_difference(a: str, b: str) -> int:
    """The index of the first character where `a` and `b` differ (the shorter one's length
    where it is a prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def format_table(runs: list[dict[str, Any]], args: argparse.Namespace, argv: list[str]) -> str:
    """The report: one row per cell, both servers and their ratios, then the CPU, the command
    lines and the comparison of the texts."""
    by = {(r["server"], x["workload"], x["concurrency"]): x for r in runs for x in r["rows"]}
    lines = [
        f"speculative decoding against none: {Path(args.model or 'default model').name}, "
        f"greedy chat completions of at most {args.max_tokens} tokens, streamed",
        "",
        "| workload | streams | requests | none tok/s | spec tok/s | ratio | none TPOT ms "
        "| spec TPOT ms | ratio | acceptance rate | mean acceptance length | failed (none/spec) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in args.workload_list:
        for c in args.concurrency_list:
            none, spec = by.get(("none", workload, c)), by.get(("spec", workload, c))
            if none is None and spec is None:
                continue
            n, s = none or {}, spec or {}
            requests = (none or spec or {})["completed"] + (none or spec or {})["failed"]
            lines.append(
                f"| {workload} | {c} | {requests} | {_cell(n, 'output_throughput')} | "
                f"{_cell(s, 'output_throughput')} | {_ratio(s, n, 'output_throughput')} | "
                f"{_cell(n, 'mean_tpot_ms')} | {_cell(s, 'mean_tpot_ms')} | "
                f"{_ratio(s, n, 'mean_tpot_ms')} | {_cell(s, 'acceptance_rate', '.3f')} | "
                f"{_cell(s, 'mean_acceptance_length', '.2f')} | "
                f"{n.get('failed', '-')}/{s.get('failed', '-')} |"
            )
    lines.append(f"\nCPU: {cpu_model()}")
    lines.append(f"bench: triode bench spec {shlex.join(argv)}")
    lines += [f"{r['server']}: {shlex.join(r['command'])}" for r in runs]
    lines.append(identity_line(differences(runs)))
    return "\n".join(lines)


def identity_line(found: dict[str, Any]) -> str:
    """Whether the greedy texts were identical, and where not."""
    if not found:
        return "greedy outputs: not compared (one server only)"
    differ = found["differ"]
    if not differ:
        return f"greedy outputs identical: all {found['compared']} requests compared"
    where = ", ".join(
        f"{d['workload']}@{d['concurrency']} #{d['index']} (from char {d['at']})" for d in differ
    )
    return f"greedy outputs NOT identical: {len(differ)} of {found['compared']} differ: {where}"


def _cell(row: dict[str, Any], key: str, spec: str = ",.1f") -> str:
    value = row.get(key, math.nan)
    return "-" if math.isnan(value) else format(value, spec)


def _ratio(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    a, b = row.get(key, math.nan), base.get(key, math.nan)
    return f"{a / b:.2f}x" if b and not (math.isnan(a) or math.isnan(b)) else "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench spec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="the model (default: the default model)")
    parser.add_argument(
        "--speculative-config",
        default=DEFAULT_SPECULATIVE_CONFIG,
        help=f"the speculating server's JSON (default: {DEFAULT_SPECULATIVE_CONFIG}); empty: "
        "it runs without speculation too, a run that shows the bench's own noise",
    )
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument(
        "--concurrency",
        "--concurrencies",
        dest="concurrencies",
        default="1,8,32",
        help="comma-separated stream counts",
    )
    parser.add_argument(
        "--requests-per-cell", type=int, help="(default: twice the streams, at least 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, help="the servers' (default: their own)")
    parser.add_argument("--seed", type=int, default=0, help="draws the grounded passages")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    args.concurrency_list = concurrency_list(parser, args.concurrencies)
    args.server_list = [s for s in args.servers.split(",") if s]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    if not args.server_list or not set(args.server_list) <= set(SERVERS):
        parser.error(f"--servers takes {', '.join(SERVERS)}")
    if not args.workload_list or not set(args.workload_list) <= set(WORKLOADS):
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}")
    if args.max_tokens < 1 or (args.requests_per_cell is not None and args.requests_per_cell < 1):
        parser.error("--max-tokens and --requests-per-cell must be >= 1")
    try:
        if args.speculative_config and not isinstance(json.loads(args.speculative_config), dict):
            raise ValueError("not an object")
    except ValueError as e:
        parser.error(f"--speculative-config must be a JSON object: {e}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    runs = [trio.run(measure, server, args) for server in args.server_list]
    print(format_table(runs, args, argv))
    if args.json:
        report = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                  "differences": differences(runs), "cpu": cpu_model()}  # fmt: skip
        args.json.write_text(json.dumps(json_safe(report), indent=2))


if __name__ == "__main__":
    main()
