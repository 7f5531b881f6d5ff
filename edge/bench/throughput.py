"""`triode bench throughput`: offline generation throughput, triode's engine against Hugging
Face `generate` on the same prompts, side by side in one run.

Measures output tokens/s for 1 sequence and for N concurrent sequences (each exactly
`--new-tokens` tokens, ignore_eos), time to first token, peak RSS of each side, and whether
bfloat16 and float32 greedy text agree on the test prompts. Where they part, it prints how far
below its own pick float32 ranks bfloat16's token at that position: a few hundredths of a nat is
a near-tie that float32 itself resolves by rounding, not a worse answer.

With `--tensor-parallel-size`, `--pipeline-parallel-size` or `--layouts`, it compares parallel
layouts (TPxPP, one worker process per rank, the CPUs shared equally between the ranks) against
a world of one instead, in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import trio

from triode.actors import SamplingParams, open_engine

TOPICS = [
    "the sea", "a lighthouse", "autumn", "a robot", "trains", "the moon", "a garden", "chess",
    "winter", "a city at night", "bees", "mountains", "a library", "rain", "coffee", "a comet",
]  # fmt: skip


def _prompt_texts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _timed(engine, prompt: list[int], params: SamplingParams) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Returns (time to first token, tokens generated)."""
    start = time.perf_counter()
    ttft, tokens = float("nan"), 0
    async for out in engine.generate(prompt, params):
        if tokens == 0 and out.outputs[0].token_ids:
            ttft = time.perf_counter() - start
        tokens = len(out.outputs[0].token_ids)
    return ttft, tokens


async def bench_triode(
    model: str | None,
    dtype: str,
    prompts: list[list[int]],
    new_tokens: int,
    **engine_args: object,
) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    async with open_engine(
        model, dtype=dtype, max_num_seqs=max(64, len(prompts)), **engine_args
    ) as engine:
        await _timed(engine, prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        start = time.perf_counter()
        ttft, tokens = await _timed(engine, prompts[0], params)
        single = tokens / (time.perf_counter() - start)

        results: list[tuple[float, int]] = []

        async def one(prompt: list[int]) -> None:
            results.append(await _timed(engine, prompt, params))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        elapsed = time.perf_counter() - start
        engine_pid = engine.pid
        rss = _peak_rss_mb(engine_pid) + resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rss += sum(_peak_rss_mb(pid) for pid in engine.worker_pids)
        return {
            "dtype": engine.dtype,
            "model_dir": str(engine.model_dir),
            "single_tok_s": single,
            "concurrent": len(prompts),
            "concurrent_tok_s": sum(t for _, t in results) / elapsed,
            "ttft_s": ttft,
            "concurrent_mean_ttft_s": sum(t for t, _ in results) / len(results),
            "peak_rss_mb": rss,
        }


class Greedy(NamedTuple):
    token_ids: list[int]
    top: list[dict[int, float]]  # per position: the 5 most likely tokens' logprobs


async def greedy_tokens(
    model: str | None, dtype: str, prompts: list[str], tokens: int
) -> list[Greedy]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    async with open_engine(model, dtype=dtype) as engine:
        results = []
        for prompt in prompts:
            final = None
            async for final in engine.generate(prompt, params):  # noqa: B007 - keep the last
                pass
            assert final is not None and final.outputs[0].logprobs is not None
            output = final.outputs[0]
            top = [dict(position.top) for position in output.logprobs or []]
            results.append(Greedy(output.token_ids, top))
        return results


class Agreement(NamedTuple):
    agree: int
    prompts: int
    partings: list[str]  # one line per prompt that parts: where, and float32's margin there


def agreement(bf16: list[Greedy], f32: list[Greedy]) -> Agreement:
    partings = []
    for i, (ours, ref) in enumerate(zip(bf16, f32, strict=True)):
        pairs = zip(ours.token_ids, ref.token_ids, strict=True)
        at = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        if at is None:
            continue
        top = ref.top[at]
        chosen, other = ref.token_ids[at], ours.token_ids[at]
        if other in top:
            margin = f"{top[chosen] - top[other]:.3f} nats below its own"
        else:
            gap = top[chosen] - min(top.values())
            margin = f"outside its top 5, more than {gap:.3f} nats below its own"
        partings.append(f"prompt {i}, token {at}: float32 ranks bfloat16's token {margin}")
    return Agreement(len(bf16) - len(partings), len(bf16), partings)


def bench_hf(
    model_dir: str, dtype: str, prompts: list[list[int]], new_tokens: int, batch: int
) -> dict:
    done = subprocess.run(
        [
            sys.executable, "-m", "triode.gpu.bench.hf_baseline", model_dir, "--dtype", dtype,
            "--prompts", json.dumps(prompts), "--new-tokens", str(new_tokens),
            "--batch", str(batch),
        ],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(ours: dict, hf: dict, agree: Agreement) -> str:
    rows = [
        ("output tok/s, 1 sequence", ours["single_tok_s"], hf["single_tok_s"], ">= 2x"),
        (
            f"output tok/s, {ours['concurrent']} concurrent (HF: batches of {hf['batch']})",
            ours["concurrent_tok_s"],
            hf["batch_tok_s"],
            ">= 2x",
        ),
        ("time to first token, 1 sequence (ms)", ours["ttft_s"] * 1e3, hf["ttft_s"] * 1e3, ""),
        ("peak RSS (MB)", ours["peak_rss_mb"], hf["peak_rss_mb"], "triode <= 2048"),
    ]
    verdicts = [
        ours["single_tok_s"] >= 2 * hf["single_tok_s"],
        ours["concurrent_tok_s"] >= 2 * hf["batch_tok_s"],
        None,
        ours["peak_rss_mb"] <= 2048,
    ]
    lines = [f"{'':58} {'triode':>10} {'HF generate':>12} {'ratio':>7}  target"]
    for (name, a, b, target), ok in zip(rows, verdicts, strict=True):
        verdict = "" if ok is None else ("MET" if ok else "NOT MET")
        lines.append(f"{name:58} {a:10.1f} {b:12.1f} {a / b:6.2f}x  {target} {verdict}")
    lines.append(
        f"{'bfloat16 vs float32 greedy, first 16 tokens agree':58} {agree.agree:>6}/"
        f"{agree.prompts} prompts  {'MET' if agree.agree == agree.prompts else 'NOT MET'}"
    )
    lines.extend(f"  {line}" for line in agree.partings)
    lines.append(f"(triode dtype: {ours['dtype']}; model: {ours['model_dir']})")
    return "\n".join(lines)


def parse_layouts(spec: str) -> list[tuple[int, int]]:
    """ "1x1,2x1,1x2" -> [(1, 1), (2, 1), (1, 2)] (tensor x pipeline parallel sizes)."""
    layouts = []
    for part in spec.split(","):
        tp, sep, pp = part.strip().lower().partition("x")
        if not sep or not tp.isdigit() or not pp.isdigit() or int(tp) < 1 or int(pp) < 1:
            raise ValueError(f"a layout is TPxPP, such as 2x1, not {part!r}")
        layouts.append((int(tp), int(pp)))
    return layouts


def _layouts(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.layouts:
        return parse_layouts(args.layouts)
    layouts = [(1, 1)]
    if args.tensor_parallel_size or args.pipeline_parallel_size:
        tp, pp = args.tensor_parallel_size or 1, args.pipeline_parallel_size or 1
        layouts += [(tp, 1)] if tp > 1 else []
        layouts += [(1, pp)] if pp > 1 else []
        layouts += [(tp, pp)] if tp > 1 and pp > 1 else []
    return layouts


def layout_table(results: list[tuple[tuple[int, int], dict]]) -> str:
    """One row per layout; ratios against the first (the world of one)."""
    base = results[0][1]
    concurrent = base["concurrent"]
    lines = [
        f"{'layout (TPxPP)':16} {'ranks':>5} {'1 seq tok/s':>12} {'ratio':>6} "
        f"{f'{concurrent} seq tok/s':>12} {'ratio':>6} {'TTFT ms':>8} {'peak RSS MB':>12}"
    ]
    for (tp, pp), r in results:
        label = f"{tp}x{pp}" + (" (in-process)" if tp * pp == 1 else "")
        single, many = r["single_tok_s"], r["concurrent_tok_s"]
        lines.append(
            f"{label:16} {tp * pp:5d} {single:12.1f} {single / base['single_tok_s']:5.2f}x "
            f"{many:12.1f} {many / base['concurrent_tok_s']:5.2f}x "
            f"{r['ttft_s'] * 1e3:8.1f} {r['peak_rss_mb']:12.0f}"
        )
    lines.append(f"(dtype: {base['dtype']}; model: {base['model_dir']})")
    return "\n".join(lines)


def _bench_layouts(args: argparse.Namespace, layouts: list[tuple[int, int]]) -> None:
    async def run() -> list[tuple[tuple[int, int], dict]]:
        texts = _prompt_texts(args.concurrency)
        async with open_engine(args.model, dtype="float32", max_num_seqs=8) as engine:
            prompts = [engine.encode(t) for t in texts]
        results = []
        for tp, pp in layouts:
            result = await bench_triode(
                args.model,
                args.dtype,
                prompts,
                args.new_tokens,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
            )
            print(f"{tp}x{pp}: {result}", file=sys.stderr)
            results.append(((tp, pp), result))
        return results

    results = trio.run(run)
    print(layout_table(results))
    if args.json:
        args.json.write_text(json.dumps([[list(k), v] for k, v in results], indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="triode bench throughput", description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    parser.add_argument("--layouts", default=None, help="TPxPP list to compare, e.g. 1x1,2x1,1x2")
    args = parser.parse_args(argv)
    layouts = _layouts(args)
    if len(layouts) > 1:
        _bench_layouts(args, layouts)
        return

    async def ours_and_agreement() -> tuple[dict, Agreement, list[list[int]]]:
        texts = _prompt_texts(args.concurrency)
        async with open_engine(args.model, dtype="float32", max_num_seqs=8) as engine:
            prompts = [engine.encode(t) for t in texts]
        ours = await bench_triode(args.model, args.dtype, prompts, args.new_tokens)
        checks = texts[:4]
        bf16 = await greedy_tokens(args.model, "bfloat16", checks, 16)
        f32 = await greedy_tokens(args.model, "float32", checks, 16)
        return ours, agreement(bf16, f32), prompts

    ours, agree, prompts = trio.run(ours_and_agreement)
    hf_dtype = "bfloat16" if ours["dtype"] == "bfloat16" else "float32"
    hf = bench_hf(ours["model_dir"], hf_dtype, prompts, args.new_tokens, args.hf_batch)
    print(_table(ours, hf, agree))
    if args.json:
        args.json.write_text(
            json.dumps({"triode": ours, "hf": hf, "agree": agree._asdict()}, indent=2)
        )


if __name__ == "__main__":
    main()
