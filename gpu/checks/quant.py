"""`python -m triode.gpu.checks.quant MODEL`: how far the integer mode (`--gguf-arithmetic
integer`) moves a GGUF model's predictions from the exact mode's.

The exact runner continues a few prompts greedily until the texts hold `--positions` tokens
after their first; both runners then read those texts teacher-forced (one prompt step each, with
prompt logprobs) and the check prints, over every position: how often the integer mode's top
token is the exact mode's, and the largest difference between the two modes' logprobs of the
text's own next token. Both in float32, as `--dtype float32` serves. Exit status 1 where no
projection runs in the integer mode (the file has none of its types, `gguf_kernels.INT8_TYPES`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from triode.wire import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

from ..layers import LinearBase
from ..loader import resolve_model
from ..model_runner import ModelRunner
from ..quant_matmul import GgufRows
from .gguf import PROMPTS, greedy


def prompt_logprobs(runner: ModelRunner, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced over `tokens` in one step: per position from the second, the text's own
    token's logprob and the top token's id."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    blocks = list(range(-(-(len(tokens) + 1) // runner.block_size)))
    request = ScheduledRequest("t", tokens, 0, blocks, new=NewRequestData(list(tokens), params))
    result = runner.execute(SchedulerOutput(0, [request])).results[-1]
    runner.execute(SchedulerOutput(1, [], finished_request_ids=["t"]))
    assert result.prompt_logprobs is not None
    rows = result.prompt_logprobs
    return rows.logprobs[:, 0], rows.token_ids[:, 1]


def integer_projections(runner: ModelRunner) -> int:
    """The projections (and LM head) with a part in the integer mode."""
    modules = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    kernels = [getattr(m, "quant", None) for m in [*modules, runner.model.lm_head]]
    return sum(isinstance(k, GgufRows) and k.in_integers for k in kernels)


def check(model: str | None, positions: int) -> tuple[str, bool]:
    """One line on `model`, and whether any projection ran in the integer mode."""
    from transformers import AutoTokenizer  # the prompts' only

    model_dir = resolve_model(model)
    options = {"dtype": "float32", "kv_cache_memory": 64 << 20, "max_model_len": 1024}
    exact = ModelRunner(model_dir, gguf_arithmetic="exact", **options)  # type: ignore[arg-type]
    integer = ModelRunner(model_dir, gguf_arithmetic="integer", **options)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    steps = -(-positions // len(PROMPTS))
    same, count, worst = 0, 0, 0.0
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        continuation, _ = greedy(exact, prompt, steps)
        tokens = prompt + continuation
        exact_lp, exact_top = prompt_logprobs(exact, tokens)
        integer_lp, integer_top = prompt_logprobs(integer, tokens)
        same += int((exact_top == integer_top).sum())
        count += len(exact_top)
        worst = max(worst, float(np.abs(exact_lp - integer_lp).max()))
    taken = integer_projections(integer)
    line = (
        f"{model_dir.name}: {taken} projections in the integer mode; top token as the exact "
        f"mode's at {same}/{count} positions ({same / count:.1%}), largest logprob difference "
        f"{worst:.3f}"
    )
    return line, taken > 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m triode.gpu.checks.quant",
        description="The integer mode's agreement with the exact mode on a GGUF model.",
    )
    parser.add_argument("model", nargs="?", help="a .gguf file or its directory (default model)")
    parser.add_argument("--positions", type=int, default=500)
    args = parser.parse_args(argv)
    line, ran = check(args.model, args.positions)
    print(line)
    if not ran:
        print("no projection of this model has a type of the integer mode")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
