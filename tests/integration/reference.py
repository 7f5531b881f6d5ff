"""Hugging Face transformers on the same weights: the ground truth for the engine tests."""

from __future__ import annotations

import functools
from pathlib import Path

from triode.gpu.loader import transformers_directory


@functools.cache
def _hf(model_dir: Path):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        transformers_directory(model_dir), dtype=torch.float32
    ).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


class Reference:
    """Hugging Face transformers on the same weights: the ground truth for greedy decoding."""

    def __init__(self, model_dir: Path) -> None:
        self.model, self.tokenizer = _hf(model_dir)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def chat(self, content: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @functools.cache  # noqa: B019 - the reference lives for the session
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        """Argmax decoding of exactly `max_new_tokens` (EOS does not stop it: the engine tests
        run with ignore_eos), recomputing the whole sequence each step."""
        import torch

        ids = list(prompt_ids)
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]

    def log_softmax(self, token_ids: list[int]):  # type: ignore[no-untyped-def]
        """Log-probabilities the model gives each next token along `token_ids`."""
        import torch

        with torch.inference_mode():
            logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
