"""`python -m triode.gpu.checks.gguf FILE...`: does triode run each GGUF file as transformers does?

For each file: the weights triode holds as the file stores them (their GGML types), then a
greedy continuation of each prompt by triode (float32, the file's blocks through the CPU
kernels: `quantization` auto) and by transformers (float32, the same file's weights dequantized
by gguf), and the teacher-forced positions of triode's continuation where transformers' top
token differs, with the largest logprob difference over them. Prints one line per file and a
verdict; exit status 1 where a file's greedy tokens differ.

`make check-gguf` runs it on the default model requantized by llama.cpp's `llama-quantize` to
each of its presets (the files llama.cpp's users download).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

from ..gguf_weight import GgufWeight, type_name
from ..layers import LinearBase
from ..loader import resolve_model, transformers_directory
from ..model_runner import ModelRunner

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
    "The three primary colours are",
)


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """`steps` greedy tokens after `prompt` (the prompt as one step, then a decode a step) and
    each one's logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=0)
    blocks = list(range(-(-(len(prompt) + steps) // runner.block_size)))
    tokens, chosen, logprobs = list(prompt), [], []
    for step in range(steps):
        new = NewRequestData(list(prompt), params) if step == 0 else None
        fed = tokens if step == 0 else tokens[-1:]
        computed = 0 if step == 0 else len(tokens) - 1
        request = ScheduledRequest("r", fed, computed, blocks, new=new)
        result = runner.execute(SchedulerOutput(step, [request])).results[-1]
        assert result.token_id is not None and result.logprobs is not None
        tokens.append(result.token_id)
        chosen.append(result.token_id)
        logprobs.append(float(result.logprobs.logprobs[0, 0]))
    runner.execute(SchedulerOutput(steps, [], finished_request_ids=["r"]))
    return chosen, logprobs


def check(path: Path, steps: int) -> tuple[str, bool]:
    """One line on `path`, and whether every prompt's greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the reference's only

    model_dir = resolve_model(path)
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512)
    kinds: Counter[str] = Counter()
    for module in runner.model.modules():
        stored = module.stored if isinstance(module, LinearBase) else None
        for part in getattr(stored, "parts", (stored,)):
            if isinstance(part, GgufWeight):
                kinds[type_name(part.kind)] += 1
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()
    same, worst, differing = 0, 0.0, 0
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        ours, lps = greedy(runner, prompt, steps)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        theirs = logits.float().log_softmax(-1)
        same += ours == theirs.argmax(-1).tolist()
        differing += int((theirs.argmax(-1) != torch.tensor(ours)).sum())
        picked = theirs[torch.arange(steps), torch.tensor(ours)]
        worst = max(worst, float((picked - torch.tensor(lps)).abs().max()))
    packed = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    line = (
        f"{path.name}: {runner.quantized_projections} projections from the file ({packed}); "
        f"greedy equal on {same}/{len(PROMPTS)} prompts, {differing} of "
        f"{steps * len(PROMPTS)} positions differ, largest logprob difference {worst:.2e}"
    )
    return line, same == len(PROMPTS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m triode.gpu.checks.gguf",
        description="Greedy decoding of GGUF files by triode against transformers.",
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    ok = True
    for path in args.files:
        line, equal = check(path, args.steps)
        print(line, flush=True)
        ok &= equal
    print("every file decodes as transformers" if ok else "a file decodes otherwise")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
