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
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import llguidance
import llguidance.numpy
import numpy as np
import trio
from tokenizers import Tokenizer

from triode.actors import Engine, SamplingParams, open_engine
from triode.actors.core.structured_output import grammar_of
from triode.wire import StructuredOutputsParams

_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_STRINGS = {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A closed object whose properties are all required (so instances list them in order)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


SMALL = _object(
    {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
     "active": {"type": "boolean"}}
)  # fmt: skip
SMALL_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True}

_ITEM = _object(
    {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
     "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
     "price_cents": {"type": "integer", "minimum": 0},
     "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}}
)  # fmt: skip
NESTED = _object(
    {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
     "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
     "customer": _object(
         {"name": {"type": "string", "minLength": 1, "maxLength": 64},
          "tier": {"enum": ["free", "pro", "enterprise"]},
          "age": {"type": "integer", "minimum": 18, "maximum": 120}}),
     "items": {"type": "array", "items": _ITEM, "minItems": 1, "maxItems": 20},
     "shipping": _object(
         {"country": {"type": "string", "pattern": "^[A-Z]{2}$"},
          "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
          "express": {"type": "boolean"}})}
)  # fmt: skip
NESTED_INSTANCE = {
    "order_id": "ORD-004217", "status": "shipped",
    "customer": {"name": "Grace Hopper", "tier": "enterprise", "age": 45},
    "items": [
        {"sku": "KEY-0042", "quantity": 2, "price_cents": 1999, "tags": ["usb", "black"]},
        {"sku": "MSE-1100", "quantity": 1, "price_cents": 2450, "tags": []},
        {"sku": "CBL-0007", "quantity": 12, "price_cents": 399, "tags": ["usb-c", "1m", "gift"]},
    ],
    "shipping": {"country": "DE", "postcode": "10115", "express": False},
}  # fmt: skip

_REF = {name: {"$ref": f"#/$defs/{name}"} for name in ("date", "money", "address", "contact",
                                                       "person")}  # fmt: skip
LARGE = _object(
    {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 80},
     "created": _REF["date"], "updated": _REF["date"], "owner": _REF["person"],
     "billing_address": _REF["address"], "shipping_address": _REF["address"],
     "balance": _REF["money"], "credit_limit": _REF["money"],
     "status": {"enum": ["active", "suspended", "closed"]},
     "tier": {"enum": ["free", "pro", "enterprise"]}, "score": {"type": "number"},
     "rating": {"type": "integer", "minimum": 1, "maximum": 5}, "verified": {"type": "boolean"},
     "newsletter": {"type": "boolean"}, "tags": _STRINGS,
     "notes": {"type": "string", "maxLength": 200},
     "locale": {"type": "string", "pattern": "^[a-z]{2}-[A-Z]{2}$"},
     "timezone": {"type": "string"}, "referrer": _REF["person"],
     "emergency_contact": _REF["contact"], "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150},
     "height_cm": {"type": "number"}, "weight_kg": {"type": "number"},
     "languages": {"type": "array", "items": {"enum": ["en", "de", "fr", "es", "ja"]}},
     "last_login": _REF["date"], "login_count": {"type": "integer", "minimum": 0},
     "preferences": _object({"theme": {"enum": ["light", "dark"]},
                             "font_size": {"type": "integer", "minimum": 8, "maximum": 32}}),
     "invoices": {"type": "array", "maxItems": 10, "items": _object(
         {"number": {"type": "string", "pattern": "^INV-[0-9]{5}$"}, "total": _REF["money"],
          "date": _REF["date"]})},
     "website": {"type": "string"}}
) | {"$defs": {
    "date": _DATE,
    "money": _object({"amount_cents": {"type": "integer", "minimum": 0},
                      "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]}}),
    "address": _object({"street": {"type": "string"}, "city": {"type": "string"},
                        "postcode": {"type": "string", "pattern": "^[0-9A-Z ]{3,10}$"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    "contact": _object({"email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
                        "phone": {"type": "string", "pattern": "^\\+[0-9]{6,15}$"}}),
    "person": _object({"name": {"type": "string"}, "contact": _REF["contact"],
                       "address": _REF["address"]}),
}}  # fmt: skip
_ADDRESS = {"street": "Unter den Linden 6", "city": "Berlin", "postcode": "10117", "country": "DE"}
_CONTACT = {"email": "ada@example.com", "phone": "+4930123456"}
_PERSON = {"name": "Ada Lovelace", "contact": _CONTACT, "address": _ADDRESS}
LARGE_INSTANCE = {
    "id": 1815, "name": "Analytical Engines Ltd", "created": "2024-01-15",
    "updated": "2025-06-30", "owner": _PERSON, "billing_address": _ADDRESS,
    "shipping_address": {"street": "1 Main St", "city": "Boston", "postcode": "02108",
                         "country": "US"},
    "balance": {"amount_cents": 125000, "currency": "EUR"},
    "credit_limit": {"amount_cents": 500000, "currency": "EUR"}, "status": "active",
    "tier": "pro", "score": 87.25, "rating": 4, "verified": True, "newsletter": False,
    "tags": ["priority", "b2b", "emea"], "notes": "Prefers invoices by email.",
    "locale": "en-GB", "timezone": "Europe/London",
    "referrer": {"name": "Charles Babbage", "contact": {"email": "cb@example.org",
                 "phone": "+441234567890"}, "address": _ADDRESS},
    "emergency_contact": _CONTACT, "age": 36, "height_cm": 165.5, "weight_kg": 58.0,
    "languages": ["en", "fr"], "last_login": "2025-07-01", "login_count": 342,
    "preferences": {"theme": "dark", "font_size": 14},
    "invoices": [
        {"number": "INV-00017", "total": {"amount_cents": 9900, "currency": "EUR"},
         "date": "2025-05-01"},
        {"number": "INV-00018", "total": {"amount_cents": 12900, "currency": "EUR"},
         "date": "2025-06-01"},
    ],
    "website": "https://example.com",
}  # fmt: skip

# Part 2's constraint: valid outputs hold at least 200 strings, so none ends within 128 tokens.
SERVE_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200}
SERVE_INSTANCE = ["sea", "trains", "autumn", "chess"] * 50

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "small": (SMALL, SMALL_INSTANCE),
    "nested": (NESTED, NESTED_INSTANCE),
    "large": (LARGE, LARGE_INSTANCE),
    "served": (SERVE_SCHEMA, SERVE_INSTANCE),
}

# The JSON that triode's grammars accept: compact separators (see `structured_output`).
_SEPARATORS = (",", ":")


class ModelFiles(NamedTuple):
    """What a grammar engine needs of a model: its tokenizer and its logits' width."""

    dir: Path
    vocab_size: int
    eos_ids: list[int]

    @property
    def tokenizer_file(self) -> Path:
        return self.dir / "tokenizer.json"

    @classmethod
    def of_engine(cls, engine: Engine) -> ModelFiles:
        eos = [engine.eos_token_id, *engine.extra_eos_token_ids]
        return cls(engine.model_dir, engine.vocab_size, [t for t in eos if t is not None])

    @classmethod
    def of_dir(cls, model_dir: Path) -> ModelFiles:
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(model_dir, config["vocab_size"], eos_ids)


class _Llguidance:
    def __init__(self, model: ModelFiles, threads: int | None) -> None:
        self.name = f"llguidance {importlib.metadata.version('llguidance')}"
        self.words = (model.vocab_size + 31) // 32
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(
            model.tokenizer_file.read_text(), n_vocab=model.vocab_size, eos_token=model.eos_ids
        )
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, schema: str) -> llguidance.LLMatcher:
        grammar = grammar_of(StructuredOutputsParams(json=schema))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{self.name}: {matcher.get_error()}")
        return matcher

    def matchers(self, compiled: llguidance.LLMatcher, n: int) -> list[llguidance.LLMatcher]:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list[llguidance.LLMatcher], mask: np.ndarray) -> None:
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, mask)

    def accept(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        return matcher.consume_token(token)


class _Xgrammar:
    def __init__(self, model: ModelFiles, threads: int | None) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        self.name = f"xgrammar {importlib.metadata.version('xgrammar')}"
        self.words = (model.vocab_size + 31) // 32
        start = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(model.dir)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=model.vocab_size, stop_token_ids=model.eos_ids
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher(threads or "auto")

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=_SEPARATORS
        )

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


GrammarEngine = _Llguidance | _Xgrammar
ENGINES: dict[str, type[GrammarEngine]] = {"llguidance": _Llguidance, "xgrammar": _Xgrammar}


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
            json.dumps(SCHEMAS[name][1], separators=_SEPARATORS), add_special_tokens=False
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
