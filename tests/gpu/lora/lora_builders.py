"""Random PEFT adapters over tiny models, the transformers + peft reference, and a minimal
scheduler that gives each request its adapter: what the LoRA tests share."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from runner_driver import Seq

from triode.gpu.loader import transformers_directory
from triode.gpu.model_runner import ModelRunner

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()


def build_adapter(
    model_dir: Path, out: Path, *, seed: int, b_std: float = 0.2, **lora: Any
) -> Path:
    """A PEFT LoRA adapter of `model_dir` with random A and B (`lora`: LoraConfig's options),
    saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(model_dir), LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # the same size of delta whatever the rank
                param.normal_(std=b_std)
    model.save_pretrained(out)
    return out


def reference_generate(
    model_dir: Path, adapter: Path | None, prompt: list[int], n: int
) -> list[int]:
    """transformers (+ peft with `adapter`) greedy continuation of `prompt`."""
    model = hf_model(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def runner(model_dir: Path, lora: dict[str, Any] | None = None, **kwargs: Any) -> ModelRunner:
    options: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory": 1 << 21,
        "max_model_len": 256,
        "num_threads": 1,
        "lora_config": {"max_loras": 4, "max_cpu_loras": 4, "max_lora_rank": 16} | (lora or {}),
    }
    return ModelRunner(model_dir, **(options | kwargs))


def prompt(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 250), k=n)


def reference_logprobs(model_dir: Path, adapter: Path | None, seq: Seq) -> torch.Tensor:
    """transformers (+ peft) log-probabilities of each of `seq`'s output tokens, from one
    forward over its prompt and outputs."""
    model = hf_model(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq.tokens])).logits[0]
    rows = torch.log_softmax(logits[seq.prompt_len - 1 : -1], -1)
    return rows[torch.arange(len(seq.output)), torch.tensor(seq.output)]


def our_logprobs(seq: Seq) -> torch.Tensor:
    """The runner's log-probability of each token it sampled for `seq`."""
    return torch.tensor([float(lp.logprobs[0, 0]) for lp in seq.logprobs])
