"""A request's sampling parameters, turned once into what the sampler (`sampler`) and the
logits processing (`logits_processing`) read on every step: masks, id arrays, a mirror of the
output, the seeded generator.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from triode.wire.messages import SamplingParams

# Below this temperature a request is greedy: dividing by it would overflow float32 logits.
_GREEDY_TEMPERATURE = 1e-5


class SamplingState:
    """One request's sampling state, kept by the model runner from first sight until it finishes.

    Everything that does not change between steps (allowed ids, biases, the ids min_tokens holds
    back, the prompt for the repetition penalty) becomes an array once here, not on every step;
    the allowed ids become a mask over the vocabulary, so a step costs the same however many
    of them a request names.
    Append each sampled token with `append`, never to `output_token_ids` directly: penalties
    read a numpy mirror of the output that `append` keeps.

    Raises ValueError when a token id in the parameters is outside the vocabulary.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_id: int | None,
        vocab_size: int,
    ) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.output_token_ids: list[int] = []
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

        # top_k == 1 keeps only the argmax, whatever the temperature: sample it as greedy. A
        # top_k that spans the vocabulary keeps everything: turn it off (0).
        self.top_k = params.top_k if params.top_k < vocab_size else 0
        self.greedy = params.temperature < _GREEDY_TEMPERATURE or self.top_k == 1
        self.truncates = not self.greedy and (self.top_k > 0 or params.top_p < 1.0)
        self.uses_min_p = not self.greedy and params.min_p > 0.0

        self.allowed_mask: torch.Tensor | None = None  # bool [vocab_size]
        if params.allowed_token_ids is not None:
            allowed = self._ids("allowed_token_ids", params.allowed_token_ids)
            self.allowed_mask = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
            self.allowed_mask[torch.from_numpy(allowed)] = True
        self.logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # ids, values
        if params.logit_bias:
            values = np.fromiter(params.logit_bias.values(), dtype=np.float32)
            self.logit_bias = (self._ids("logit_bias", list(params.logit_bias)), values)
        # min_tokens holds back every id that would stop the request, as vLLM does: the stop ids,
        # and EOS unless it is ignored. An id outside the vocabulary can never be sampled anyway.
        stop_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(eos_token_id)
        stop_ids = {t for t in stop_ids if t < vocab_size}
        self.min_tokens_ids: np.ndarray | None = None
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens_ids = np.array(sorted(stop_ids), dtype=np.int64)

        self.repetition = params.repetition_penalty != 1.0
        self.penalized = (
            self.repetition or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self.prompt_ids = np.asarray(prompt_token_ids, dtype=np.int64) if self.repetition else None
        self._outputs = np.empty(16 if self.penalized else 0, dtype=np.int64)

    def append(self, token_id: int) -> None:
        """Record a sampled token (the runner calls this once per step that sampled)."""
        if self.penalized:
            n = len(self.output_token_ids)
            if n == len(self._outputs):
                self._outputs = np.resize(self._outputs, 2 * n)
            self._outputs[n] = token_id
        self.output_token_ids.append(token_id)

    def ahead(self, tokens: list[int]) -> SamplingState:
        """This state as it will be once `tokens` are appended, for processing a row further on
        (a speculative proposal's verification row): penalties count `tokens` and min_tokens
        sees a longer output. Shares everything that does not change, the seeded generator
        included; the output is its own, so `self` is untouched.
        """
        view = copy.copy(self)
        view.output_token_ids = [*self.output_token_ids, *tokens]
        if self.penalized:
            known, n = len(self.output_token_ids), len(view.output_token_ids)
            view._outputs = np.empty(n + 16, dtype=np.int64)
            view._outputs[:known] = self.output_ids
            view._outputs[known:n] = tokens
        return view

    @property
    def output_ids(self) -> np.ndarray:
        """The output so far as int64 (a view: valid until the next `append`)."""
        return self._outputs[: len(self.output_token_ids)]

    def _ids(self, field: str, ids: list[int]) -> np.ndarray:
        if any(t >= self.vocab_size for t in ids):
            raise ValueError(f"{field}: token ids must be < vocabulary size {self.vocab_size}")
        return np.array(ids, dtype=np.int64)
