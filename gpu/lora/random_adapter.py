"""Random LoRA adapters in Hugging Face PEFT's format, for a model directory: what `triode bench
lora` serves and `triode bench step --lora` steps with. Written from the model's `config.json`
alone (no model is loaded, no torch): A as PEFT initialises it (uniform in +-1/sqrt(inputs)), B
random instead of PEFT's zeros, so that every adapter changes the outputs.

    python -m triode.gpu.lora.random_adapter MODEL_DIR OUT [--rank 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION + MLP


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of each projection of a Llama-family decoder layer."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }


def write_random_adapter(
    model_dir: Path,
    out: Path,
    *,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = ALL_TARGETS,
    alpha: float | None = None,
    b_std: float = 0.02,
) -> Path:
    """A PEFT LoRA adapter directory at `out` for the model at `model_dir`: rank `rank` on
    `targets` of every layer, `lora_alpha` twice the rank unless given; returns `out`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = projection_shapes(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            outputs, inputs = shapes[name]
            part = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            bound = 1 / np.sqrt(inputs)
            a = rng.uniform(-bound, bound, (rank, inputs)).astype(np.float32)
            b = rng.normal(0.0, b_std, (outputs, rank)).astype(np.float32)
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_random_adapter(args.model_dir, args.out, rank=args.rank, seed=args.seed)


if __name__ == "__main__":
    main()
