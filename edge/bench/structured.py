"""`triode bench structured`: what constrained decoding costs, in two parts.

Part 1, the grammar engines on the model's vocabulary: llguidance (what triode serves with)
beside xgrammar, when it is installed, on three JSON schemas (flat; nested with arrays, enums,
ranges and patterns; 30 properties with $defs) and part 2's. For each: the cold compile time
(a fresh matcher from the schema, no cache; the median of `--compile-runs`), compile plus the
first mask (llguidance builds its lexer lazily, xgrammar its mask cache up front), and the time
to fill the token bitmask per decoding step, walking a valid instance of the schema token by
token, for 1 sequence and for `--batch` sequences in parallel; and each engine's one-time
tokenizer set-up. Every mask is checked to allow the next token of the walk, and the last one
to allow end of sequence.

Part 2, the served cost: the same prompts through `open_engine` at each `--streams`
concurrency, greedy, unconstrained (ignore_eos) and constrained by a JSON schema whose outputs
cannot end before `--output-len` tokens; output tokens/s of each (the best of `--repeats`
runs, taking turns) and their ratio."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import trio
from tokenizers import Tokenizer

from triode.actors import Engine, SamplingParams, open_engine
from triode.wire import StructuredOutputsParams

from .grammar_engines import ENGINES, SEPARATORS, GrammarEngine, ModelFiles
from .structured_schemas import SCHEMAS, SERVE_SCHEMA


class SchemaResult(NamedTuple):
    tokens: int  # in the walked instance
    compile_ms: float  # cold, median
    first_mask_ms: float  # a cold compile and its first mask, median
    mask_us: dict[int, float]  # sequences -> microseconds per step, median over the walks


class EngineResult(NamedTuple):
    name: str
    setup_ms: float | None  # None: not installed (`missing` says why)
    schemas: dict[str, SchemaResult]
    missing: str = ""


def _allowed(mask: np.ndarray, row: int, token: int) -> bool:
    return bool(int(mask[row, token >> 5]) & (1 << (token & 31)))


def _walk(engine: GrammarEngine, compiled: Any, tokens: list[int], eos: int, n: int) -> float:
    """Microseconds per step to fill the masks of `n` matchers that walk `tokens` in lockstep,
    copied from one compiled grammar as a server's cache hands them out."""
    matchers = engine.matchers(compiled, n)
    mask = np.zeros((n, engine.words), dtype=np.int32)
    spent = 0
    for token in [*tokens, eos]:
        start = time.perf_counter_ns()
        engine.fill(matchers, mask)
        spent += time.perf_counter_ns() - start
        if not (_allowed(mask, 0, token) and _allowed(mask, n - 1, token)):
            raise ValueError(f"{engine.name}: the mask disallows token {token} of a valid walk")
        if token != eos and not all(engine.accept(m, token) for m in matchers):
            raise ValueError(f"{engine.name}: token {token} of a valid walk was refused")
    return spent / (len(tokens) + 1) / 1e3


def _median_ms(runs: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _compile_and_mask(engine: GrammarEngine, schema: str) -> None:
    engine.fill(engine.matchers(engine.compile(schema), 1), np.zeros((1, engine.words), np.int32))


def bench_schema(
    engine: GrammarEngine, schema: str, tokens: list[int], eos: int, args: argparse.Namespace
) -> SchemaResult:
    compile_ms = _median_ms(args.compile_runs, lambda: engine.compile(schema))
    first_ms = _median_ms(args.compile_runs, lambda: _compile_and_mask(engine, schema))
    compiled = engine.compile(schema)
    mask_us = {
        n: statistics.median(_walk(engine, compiled, tokens, eos, n) for _ in range(args.walks))
        for n in (1, args.batch)
    }
    return SchemaResult(len(tokens), compile_ms, first_ms, mask_us)


def bench_engines(model: ModelFiles, args: argparse.Namespace) -> list[EngineResult]:
    """Part 1: each engine on each of `args.schemas` (blocking; seconds of CPU)."""
    tokenizer = Tokenizer.from_file(str(model.tokenizer_file))
    walks = {
        name: tokenizer.encode(
            json.dumps(SCHEMAS[name][1], separators=SEPARATORS), add_special_tokens=False
        ).ids
        for name in args.schemas
    }
    results = []
    for name, kind in ENGINES.items():
        try:
            engine = kind(model, args.threads)
        except ImportError as e:
            results.append(EngineResult(name, None, {}, str(e)))
            continue
        measured = {
            schema: bench_schema(
                engine, json.dumps(SCHEMAS[schema][0]), walks[schema], model.eos_ids[0], args
            )
            for schema in args.schemas
        }
        results.append(EngineResult(engine.name, engine.setup_s * 1e3, measured))
    return results


def engine_table(results: list[EngineResult], batch: int, compile_runs: int) -> str:
    """Part 1's table: a column per engine (and their ratio), a block of rows per schema."""
    installed = [r for r in results if r.setup_ms is not None]
    ratio = len(installed) == 2
    lines = [
        f"{'grammar engines, on the model vocabulary':44}"
        + "".join(f"{r.name:>17}" for r in results)
        + (f"{'ratio':>8}" if ratio else "")
    ]

    def row(label: str, values: list[float | None], fmt: str, absent: str = "-") -> None:
        cells = [absent if v is None else f"{v:{fmt}}" for v in values]
        line = f"{label:44}" + "".join(f"{c:>17}" for c in cells)
        known = [v for v in values if v is not None]
        if ratio and len(known) == 2 and known[0]:
            line += f"{known[1] / known[0]:7.1f}x"
        lines.append(line)

    measures: list[tuple[str, Callable[[SchemaResult], float], str]] = [
        (f"  compile, cold, median of {compile_runs} (ms)", lambda s: s.compile_ms, ".2f"),
        ("  compile + first mask, cold (ms)", lambda s: s.first_mask_ms, ".2f"),
        ("  mask per step, 1 seq (us)", lambda s: s.mask_us[1], ".1f"),
        (f"  mask per step, {batch} seqs in parallel (us)", lambda s: s.mask_us[batch], ".1f"),
    ]
    row("tokenizer set-up, once (ms)", [r.setup_ms for r in results], ".1f", "not installed")
    for name in next((list(r.schemas) for r in installed), []):
        tokens = next(r.schemas[name].tokens for r in installed)
        lines.append(f"{name} schema ({_describe(SCHEMAS[name][0])}), a walk of {tokens} tokens")
        for label, value, fmt in measures:
            row(
                label, [value(r.schemas[name]) if name in r.schemas else None for r in results], fmt
            )
    if ratio:
        lines.append(f"(ratio: {installed[1].name} / {installed[0].name})")
    lines.extend(f"({r.name}: not installed: {r.missing})" for r in results if r.setup_ms is None)
    return "\n".join(lines)


def _describe(schema: dict[str, Any]) -> str:
    """The schema itself when it is short, else its size."""
    text = json.dumps(schema)
    if len(text) <= 80:
        return text
    objects = text.count('"properties"')
    return f"{len(schema['properties'])} top-level properties, {objects} objects, {len(text)} B"


class ServeRun(NamedTuple):
    seconds: float
    tokens: list[int]  # output tokens of each request

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / self.seconds


TOPICS = ["the sea", "trains", "autumn", "chess", "bees", "rain", "coffee", "a comet"]


def _prompt_texts(n: int) -> list[str]:
    return [
        f"List short words about {TOPICS[i % len(TOPICS)]} as a JSON array ({i})." for i in range(n)
    ]


async def _final_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> int:
    final = None
    async for final in engine.generate(prompt, params):  # noqa: B007 - keep the last
        pass
    assert final is not None
    return len(final.outputs[0].token_ids)


async def serve_streams(
    engine: Engine,
    prompts: Sequence[list[int]],
    streams: int,
    per_stream: int,
    params: SamplingParams,
) -> ServeRun:
    """`streams` concurrent streams, each `per_stream` requests one after another, on a cold
    prefix cache (so the run after another does not find its prompts cached)."""
    await engine.reset_prefix_cache()
    tokens: list[int] = []

    async def stream(i: int) -> None:
        for prompt in prompts[i * per_stream : (i + 1) * per_stream]:
            tokens.append(await _final_tokens(engine, prompt, params))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(stream, i)
    return ServeRun(time.perf_counter() - start, tokens)


def _params(output_len: int, constrained: bool) -> SamplingParams:
    if not constrained:
        return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    constraint = StructuredOutputsParams(json=json.dumps(SERVE_SCHEMA))
    return SamplingParams(temperature=0, max_tokens=output_len, structured_outputs=constraint)


async def bench_serve(
    engine: Engine, args: argparse.Namespace
) -> list[tuple[int, ServeRun, ServeRun]]:
    """Part 2: (streams, unconstrained, constrained) for each of `args.streams`, the faster of
    `args.repeats` runs each, the two kinds taking turns (so a neighbour's load spreads over
    both)."""
    texts = _prompt_texts(max(args.streams) * args.requests_per_stream)
    prompts = [engine.encode(t) for t in texts]
    warm_up = engine.encode("Say hello.")
    for constrained in (False, True):
        await _final_tokens(engine, warm_up, _params(4, constrained))
    results = []
    for streams in args.streams:
        runs: list[list[ServeRun]] = [[], []]
        for _ in range(args.repeats):
            for constrained in (False, True):
                params = _params(args.output_len, constrained)
                run = await serve_streams(
                    engine, prompts, streams, args.requests_per_stream, params
                )
                runs[constrained].append(run)
        for kind, tried in zip(("unconstrained", "constrained"), runs, strict=True):
            seen = ", ".join(f"{r.tok_s:.1f}" for r in tried)
            print(f"{streams} streams, {kind}: {seen} tok/s", file=sys.stderr)
        free, bound = (max(tried, key=lambda r: r.tok_s) for tried in runs)
        results.append((streams, free, bound))
    return results


def _counts(tokens: list[int]) -> str:
    low, high = min(tokens), max(tokens)
    each = f"{low} each" if low == high else f"{low}-{high}"
    return f"{sum(tokens)} ({each})"


def serve_table(
    results: list[tuple[int, ServeRun, ServeRun]], output_len: int, target: float = 0.9
) -> str:
    """Part 2's table (the best of the repeats); the target applies at the largest
    concurrency."""
    top = max(streams for streams, _, _ in results)
    lines = [
        f"{'served, greedy, max_tokens ' + str(output_len):30} {'requests':>8} "
        f"{'unconstrained':>14} {'constrained':>12} {'ratio':>7}  output tokens (unc. / con.)"
    ]
    for streams, free, bound in results:
        ratio = bound.tok_s / free.tok_s
        verdict = (
            f"  >= {target:.2f}x {'MET' if ratio >= target else 'NOT MET'}"
            if streams == top
            else ""
        )
        lines.append(
            f"{f'output tok/s, {streams} stream' + ('s' if streams > 1 else ''):30} "
            f"{len(free.tokens):8d} {free.tok_s:14.1f} {bound.tok_s:12.1f} {ratio:6.2f}x  "
            f"{_counts(free.tokens)} / {_counts(bound.tokens)}{verdict}"
        )
        if min(bound.tokens) < output_len or min(free.tokens) < output_len:
            lines.append(f"  (some requests ended before {output_len} tokens)")
    return "\n".join(lines)


def grammar_counters(stats: dict[str, Any]) -> str:
    """The engine core's structured-output counters, as far as `get_stats` reports them."""
    found = {k: v for k, v in stats.items() if "grammar" in k or "structured" in k}
    if not found:
        return (
            "structured-output manager: the engine's get_stats reports no grammar counters "
            "(compiled, cache hits)"
        )
    return "structured-output manager: " + ", ".join(f"{k} {v}" for k, v in sorted(found.items()))


async def _run(args: argparse.Namespace) -> None:
    model_dir = Path(args.model) if args.model else None
    if args.skip_serve and model_dir is not None and (model_dir / "tokenizer.json").is_file():
        print(_part1(ModelFiles.of_dir(model_dir), args), flush=True)
        return
    async with open_engine(args.model) as engine:
        if not args.skip_engines:
            print(
                await trio.to_thread.run_sync(_part1, ModelFiles.of_engine(engine), args),
                flush=True,
            )
        if args.skip_serve:
            return
        results = await bench_serve(engine, args)
        if not args.skip_engines:
            print()
        print(serve_table(results, args.output_len))
        print(grammar_counters(await engine.get_stats()))
        print(f"(dtype: {engine.dtype}; model: {engine.model_dir})")
        print(f"(constrained by {json.dumps(SERVE_SCHEMA)})")


def _part1(model: ModelFiles, args: argparse.Namespace) -> str:
    table = engine_table(bench_engines(model, args), args.batch, args.compile_runs)
    return f"{table}\n(model: {model.dir}; vocabulary {model.vocab_size})"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}")
    return value


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated, not {text!r}")
    return values


def _schemas(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    unknown = [n for n in names if n not in SCHEMAS]
    if unknown:
        raise argparse.ArgumentTypeError(f"schemas are {', '.join(SCHEMAS)}, not {unknown[0]!r}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="triode bench structured", description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--skip-engines", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-serve", action="store_true", help="leave out part 2")
    part1 = parser.add_argument_group("part 1, the grammar engines")
    part1.add_argument("--schemas", type=_schemas, default=list(SCHEMAS))
    part1.add_argument("--compile-runs", type=_positive, default=7, help="cold compiles per schema")
    part1.add_argument("--walks", type=_positive, default=3, help="mask walks per schema and batch")
    part1.add_argument("--batch", type=_positive, default=32, help="sequences filled in parallel")
    part1.add_argument("--threads", type=_positive, default=None, help="default: each engine's own")
    part2 = parser.add_argument_group("part 2, the served cost")
    part2.add_argument("--streams", type=_ints, default=[1, 32], help="concurrencies, e.g. 1,32")
    part2.add_argument("--requests-per-stream", type=_positive, default=1)
    part2.add_argument("--output-len", type=_positive, default=128)
    part2.add_argument(
        "--repeats", type=_positive, default=2, help="runs of each kind; the best counts"
    )
    args = parser.parse_args(argv)
    if args.skip_engines and args.skip_serve:
        parser.error("--skip-engines and --skip-serve leave nothing to run")
    trio.run(_run, args)


if __name__ == "__main__":
    main()
