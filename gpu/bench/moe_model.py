"""A random-weight mixture-of-experts checkpoint of realistic proportions, for `triode bench moe`.

Qwen3-MoE's shape scaled to fit a small machine: 24 layers of hidden size 1024, 16 query and 4
KV heads of 64, and 64 experts of intermediate size 256 per layer, 4 of them per token; the
default model's vocabulary (49,152), tied embeddings. 1.32 B parameters, 0.19 B of them active
per token (14%: the 4 experts' 75 M, attention's 63 M, the LM head's 50 M), as Qwen3-30B-A3B
runs 3.3 B of its 30.5 B. Built once under `$TRIODE_CACHE/bench-moe/` (5.3 GB of float32).

Run as `python -m triode.gpu.bench.moe_model`; prints the directory and the parameter counts as
one JSON object, with `--rates` also this machine's float32 matmul rate at one expert's shapes
and its memory read rate (what the expert computation is held against).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ..cache_paths import cache_dir
from ..loader import build_once
from ..tiny_model import build_tiny_model

SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "num_layers": 24,
    "num_heads": 16,
    "num_kv_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "intermediate_size": 2048,  # a dense layer's, where `mlp_only_layers` names one (none here)
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}


def parameter_counts(config: dict[str, Any]) -> dict[str, int]:
    """Total and per-token active parameters of a Qwen3-MoE config.json (norms left out)."""
    experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5's name
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head = config["head_dim"]
    attention = (
        hidden * head * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    )
    expert = 3 * hidden * config["moe_intermediate_size"]
    router = hidden * experts
    embed = config["vocab_size"] * hidden
    heads = embed if config.get("tie_word_embeddings") else 2 * embed
    total = layers * (attention + router + experts * expert) + heads
    active = layers * (attention + router + config["num_experts_per_tok"] * expert) + embed
    return {"total": total, "active": active}


def build(out: Path | None = None) -> Path:
    """The checkpoint's directory, built unless it was before."""
    return build_once(out or cache_dir() / "bench-moe", _write)


def _write(tmp: Path) -> None:
    build_tiny_model(tmp, architecture="qwen3_moe", **SHAPE)


def machine_rates(hidden: int = 1024, intermediate: int = 256, rows: int = 32) -> dict[str, float]:
    """float32 GFLOP/s of an expert's gate_up product on `rows` tokens (all cores), and GB/s
    of reading a 512 MB weight-sized buffer once (`sum`), each the best of a few runs."""
    import torch  # only here: the checkpoint's paths and counts need no torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    x = torch.randn(rows, hidden)
    w = torch.randn(2 * intermediate, hidden)
    big = torch.randn(128 << 20)
    flops, best = 0.0, float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            torch.nn.functional.linear(x, w)
        best = min(best, (time.perf_counter() - start) / 200)
    flops = 2 * rows * hidden * 2 * intermediate / best / 1e9
    read = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        read = min(read, time.perf_counter() - start)
    return {"matmul_gflops": flops, "read_gb_s": big.numel() * 4 / read / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="where to build it")
    parser.add_argument("--rates", action="store_true", help="also measure the machine's rates")
    args = parser.parse_args(argv)
    path = build(args.out)
    config = json.loads((path / "config.json").read_text())
    report = {"model": str(path), **parameter_counts(config)}
    if args.rates:
        report |= machine_rates(config["hidden_size"], config["moe_intermediate_size"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
