"""`triode bench step`: one decode step of the model runner at several batch sizes, timed and
profiled in this process, with the machine's own matmul peak beside it.

For each batch size N it prefills N requests of `--prompt-len` random tokens, decodes them to
`--context` tokens, then times `--steps` more decode steps (each `ModelRunner.execute` whole:
preparing the batch, the forward, the logits and sampling). It prints milliseconds per step,
output tokens per second, and the arithmetic rate those tokens mean (2 FLOPs per weight of each
projection and of the LM head per token, plus attention's 4 per cached token and head dimension)
against the rate of one large bfloat16 (or float32) matmul on the same threads: how far the step
is from what the matmul units give. And the other bound, memory: the bytes a step must read (every
weight as the step reads it, dense or as GGUF stores it, and each request's KV cache) at the rate
one pass over 512 MB reads memory on the same threads: the fastest the step could be.

`--profile` adds torch.profiler's table of where one batch size's steps went, operator by
operator (self CPU time).

`--lora N` steps with LoRA adapters (N random ones of `--lora-rank` on every projection): at each
batch size, three batches decode side by side, a step of each in turn: every request on the base
model, every request on one adapter, and the requests taking the N adapters in turn; it prints
each one's milliseconds per step (the median step) and the adapters' cost against the base's.
`--profile` then profiles the mixed batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

from ..loader import resolve_model
from ..lora.random_adapter import write_random_adapter
from ..model_runner import ModelRunner
from ..vocab_layers import VocabParallelEmbedding

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


class Batch:
    """N requests decoding together, their blocks handed out in order (from `free`, which
    batches decoding side by side share); request i runs with adapter `lora_ids[i]` (0: the
    base model)."""

    def __init__(
        self,
        runner: ModelRunner,
        n: int,
        prompt_len: int,
        seed: int,
        *,
        free: list[int] | None = None,
        lora_ids: list[int] | None = None,
        name: str = "r",
    ) -> None:
        self.runner, self.step_count = runner, 0
        rng = random.Random(seed)
        vocab = runner.vocab_size
        self.tokens = {
            f"{name}{i}": [rng.randrange(vocab) for _ in range(prompt_len)] for i in range(n)
        }
        self.lora_ids = dict(zip(self.tokens, lora_ids or [0] * n, strict=True))
        self.computed = dict.fromkeys(self.tokens, 0)
        self.blocks: dict[str, list[int]] = {r: [] for r in self.tokens}
        self.free = free if free is not None else list(range(runner.num_kv_blocks))
        self.announced: set[str] = set()

    def step(self) -> None:
        bs, budget = self.runner.block_size, self.runner.max_num_batched_tokens
        scheduled = []
        for request_id, tokens in self.tokens.items():
            begin, end = self.computed[request_id], len(tokens)
            if end - begin > budget:
                break  # prompts wait for a later step, as a scheduler keeps them
            budget -= end - begin
            blocks = self.blocks[request_id]
            while len(blocks) * bs < end:
                blocks.append(self.free.pop(0))
            new = None
            if request_id not in self.announced:
                new = NewRequestData(list(tokens), GREEDY, lora_id=self.lora_ids[request_id])
                self.announced.add(request_id)
            scheduled.append(
                ScheduledRequest(request_id, tokens[begin:end], begin, list(blocks), new=new)
            )
        out = self.runner.execute(SchedulerOutput(self.step_count, scheduled))
        self.step_count += 1
        for r in scheduled:
            self.computed[r.request_id] += len(r.token_ids)
        for result in out.results:
            if self.computed[result.request_id] == len(self.tokens[result.request_id]):
                self.tokens[result.request_id].append(result.token_id)

    def finish(self) -> None:
        ids = list(self.tokens)
        self.runner.execute(SchedulerOutput(self.step_count, [], finished_request_ids=ids))
        for blocks in self.blocks.values():
            self.free += blocks


def flops_per_token(runner: ModelRunner, context: int) -> float:
    """2 per projection weight (LM head included) plus attention's QK and PV products."""
    config = runner.config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    q = config.num_attention_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
    weights = layers * per_layer + config.vocab_size * hidden
    attention = layers * 4 * context * q
    return 2.0 * weights + attention


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeat: int = 5) -> float:
    """FLOP/s of a [size, size] x [size, size] matmul in `dtype`, best of `repeat`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def step_bytes(runner: ModelRunner, n: int, context: int) -> float:
    """Bytes a decode step of `n` requests at `context` tokens reads: every projection's and
    the LM head's weights as the step reads them for decode rows (a GGUF file's blocks where
    the kernels take them, else the dense or oneDNN-packed weights), norms, and each request's
    K and V for every layer. An embedding reads a row a request: not counted."""
    total = 0
    for module in runner.model.modules():
        if (quant := getattr(module, "quant", None)) is not None:
            total += quant.weight_bytes
        elif (four_bit := getattr(module, "int4", None)) is not None:  # torch's kernel's
            total += four_bit.packed.nbytes + four_bit.scales_and_zeros.nbytes
        elif type(module) is VocabParallelEmbedding:
            continue  # a row a request
        elif getattr(module, "packed", None) is not None:
            total += module.packed.nbytes
        elif isinstance(weight := getattr(module, "weight", None), torch.Tensor):
            total += weight.nbytes
    layers = runner.model.model.stage_layers
    attn = layers[0].self_attn.attn
    kv = 2 * attn.num_kv_heads * attn.head_dim * runner.kv_cache.element_size()
    return total + n * context * len(layers) * kv


def read_bandwidth(size: int = 512 << 20, repeat: int = 3) -> float:
    """Bytes per second one sum over `size` bytes of float32 reads, best of `repeat`."""
    x = torch.ones(size // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return size / best


def time_steps(runner: ModelRunner, n: int, args: argparse.Namespace) -> float:
    """Seconds per decode step of `n` requests at `args.context` tokens of context."""
    batch = Batch(runner, n, args.prompt_len, args.seed)
    while min(batch.computed.values()) < args.context:
        batch.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        batch.step()
    elapsed = (time.perf_counter() - start) / args.steps
    batch.finish()
    return elapsed


LORA_LOADS = ("base", "one adapter", "mixed adapters")


def lora_batches(runner: ModelRunner, n: int, args: argparse.Namespace) -> dict[str, Batch]:
    """The three batches of `--lora` (base, one adapter, the adapters in turn) of `n` requests
    each, decoded to `args.context` tokens, sharing the KV blocks."""
    free = list(range(runner.num_kv_blocks))
    ids = {
        "base": [0] * n,
        "one adapter": [1] * n,
        "mixed adapters": [1 + i % args.lora for i in range(n)],
    }
    batches = {
        load: Batch(
            runner, n, args.prompt_len, args.seed, free=free, lora_ids=ids[load], name=load[0]
        )
        for load in LORA_LOADS
    }
    for batch in batches.values():
        while min(batch.computed.values()) < args.context:
            batch.step()
    return batches


def time_lora_steps(runner: ModelRunner, n: int, args: argparse.Namespace) -> dict[str, float]:
    """The median seconds of a decode step of each `--lora` batch, their steps taking turns."""
    batches = lora_batches(runner, n, args)
    times: dict[str, list[float]] = {load: [] for load in LORA_LOADS}
    for _ in range(args.steps):
        for load, batch in batches.items():
            start = time.perf_counter()
            batch.step()
            times[load].append(time.perf_counter() - start)
    for batch in batches.values():
        batch.finish()
    return {load: statistics.median(seconds) for load, seconds in times.items()}


def add_random_adapters(runner: ModelRunner, args: argparse.Namespace, scratch: Path) -> None:
    """`args.lora` random adapters of `args.lora_rank`, loaded as ids 1.. on the runner."""
    assert runner.lora is not None
    for i in range(1, args.lora + 1):
        path = write_random_adapter(
            runner.model_dir, scratch / f"adapter-{i}", rank=args.lora_rank, seed=args.seed + i
        )
        runner.lora.add(i, str(path))


def profile_steps(runner: ModelRunner, n: int, args: argparse.Namespace) -> str:
    if args.lora:
        batch = lora_batches(runner, n, args)["mixed adapters"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                batch.step()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    batch = Batch(runner, n, args.prompt_len, args.seed)
    while min(batch.computed.values()) < args.context:
        batch.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            batch.step()
    batch.finish()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="triode bench step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="a model directory or .gguf (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated")
    parser.add_argument("--prompt-len", type=int, default=37)
    parser.add_argument("--context", type=int, default=100, help="tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--gguf-arithmetic", default="exact", choices=("exact", "integer"))
    parser.add_argument("--profile", type=int, metavar="N", help="profile the steps of N requests")
    parser.add_argument("--rows", type=int, default=25, help="rows of the profile table")
    parser.add_argument("--lora", type=int, default=0, metavar="N", help="N random adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.sizes = [int(n) for n in args.batch_sizes.split(",")]
    if args.lora < 0 or args.lora_rank < 1:
        parser.error("--lora must be >= 0 and --lora-rank >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    largest = max([*args.sizes, args.profile or 0])
    model_dir = resolve_model(Path(args.model) if args.model else None)
    batches = 3 if args.lora else 1  # the --lora batches decode side by side
    tokens = max(batches * largest * (args.context + args.steps + 32), args.max_model_len)
    lora_config = None
    if args.lora:
        lora_config = {"max_loras": args.lora, "max_cpu_loras": args.lora}
        lora_config["max_lora_rank"] = args.lora_rank
    runner = ModelRunner(
        model_dir,
        dtype=args.dtype,
        quantization=args.quantization,
        gguf_arithmetic=args.gguf_arithmetic,
        kv_cache_memory=_kv_bytes(model_dir, tokens),
        max_model_len=args.max_model_len,
        max_num_seqs=max(256, largest),
        lora_config=lora_config,
    )
    peak, bandwidth = matmul_peak(runner.dtype), read_bandwidth()
    flops = flops_per_token(runner, args.context)
    print(
        f"{runner.model_dir.name}: {runner.dtype}, "
        f"{runner.quantized_projections} projections as GGUF stores them, "
        f"{torch.get_num_threads()} threads; {flops / 1e9:.3f} GFLOP per token at "
        f"{args.context} tokens of context; {runner.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s; "
        f"memory reads {bandwidth / 1e9:.1f} GB/s"
    )
    with tempfile.TemporaryDirectory(prefix="triode-step-lora-") as scratch:
        if args.lora:
            add_random_adapters(runner, args, Path(scratch))
            print_lora_table(runner, args)
        else:
            print(
                "| batch | ms per step | tok/s | GFLOP/s | of peak | MB read | bound ms | of it |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for n in args.sizes:
                seconds = time_steps(runner, n, args)
                rate, read = n / seconds, step_bytes(runner, n, args.context)
                print(
                    f"| {n} | {seconds * 1e3:.1f} | {rate:,.0f} | {rate * flops / 1e9:.0f} | "
                    f"{rate * flops / peak:.0%} | {read / 1e6:.0f} | "
                    f"{read / bandwidth * 1e3:.1f} | {read / bandwidth / seconds:.0%} |"
                )
        if args.profile:
            print(profile_steps(runner, args.profile, args))


def print_lora_table(runner: ModelRunner, args: argparse.Namespace) -> None:
    print(
        f"{args.lora} adapters of rank {args.lora_rank} on every projection; median step of "
        f"{args.steps}, the three batches stepping in turn"
    )
    print("| batch | base ms | one adapter ms | of base | mixed ms | of base |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        ms = {load: seconds * 1e3 for load, seconds in time_lora_steps(runner, n, args).items()}
        base, one, mixed = (ms[load] for load in LORA_LOADS)
        print(
            f"| {n} | {base:.1f} | {one:.1f} | {base / one:.2f}x | {mixed:.1f} | "
            f"{base / mixed:.2f}x |"
        )


def _kv_bytes(model_dir: Path, tokens: int) -> int:
    """Room for `tokens` tokens of float32 K and V in every layer, twice over."""
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    return 2 * tokens * per_token


if __name__ == "__main__":
    main()
