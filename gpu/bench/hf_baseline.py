"""The baseline for `triode bench throughput`: Hugging Face `generate` on the same prompts.

Run as `python -m triode.gpu.bench.hf_baseline MODEL_DIR --dtype bfloat16 ...`; prints one JSON
object. It runs in its own process so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _generate(model, batch: list[list[int]], new_tokens: int, pad: int) -> float:  # type: ignore[no-untyped-def]
    """Left-padded batch, greedy, exactly `new_tokens` each; returns seconds."""
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return time.perf_counter() - start


def run(model_dir: str, dtype: str, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype))
    model.eval()
    pad = AutoTokenizer.from_pretrained(model_dir).eos_token_id or 0
    _generate(model, prompts[:1], 4, pad)  # warm-up
    single = _generate(model, prompts[:1], new_tokens, pad)
    ttft = _generate(model, prompts[:1], 1, pad)
    batched, done = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        batched += _generate(model, chunk, new_tokens, pad)
        done += len(chunk)
    return {
        "single_tok_s": new_tokens / single,
        "batch": batch,
        "batch_tok_s": done * new_tokens / batched,
        "ttft_s": ttft,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    prompts = json.loads(args.prompts)
    print(json.dumps(run(args.model_dir, args.dtype, prompts, args.new_tokens, args.batch)))


if __name__ == "__main__":
    main()
