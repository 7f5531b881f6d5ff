"""The encoder runner: the pooling counterpart of `ModelRunner` for BERT encoders, one
`SchedulerOutput` of whole prompts in, their pooled outputs out.

An encoder attends both ways over a whole prompt, so each request runs in the one step that
carries all of its tokens and keeps nothing after it: there is no KV cache. The scheduler
still allocates blocks for the tokens it schedules, so the runner reports a virtual block
count, enough for two full steps, that nothing is stored in.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triode.wire import ModelRunnerOutput, RequestStepResult, ScheduledRequest, SchedulerOutput

from . import parallel_state
from .loader import resolve_model
from .model_runner import resolve_dtype
from .models.bert import load_encoder, pool
from .pooling_spec import ENCODER_ARCHITECTURES, PoolingSpec, is_encoder, pooling_spec


class EncoderRunner:
    """Runs a BERT encoder (`models.bert`) from a Hugging Face directory, pooling each
    prompt's hidden states as its `pooling_spec` says.

    What the scheduler and the engine core read, as `ModelRunner` offers them: `num_kv_blocks`
    of `block_size` tokens (virtual: `2 * (max_num_batched_tokens // block_size +
    max_num_seqs)`, two full steps' worth), `max_model_len` (the least of the position
    embeddings, sentence-transformers' `max_seq_length` and the one asked for), no
    end-of-sequence ids, `vocab_size`, `hidden_size`, `dtype`, `device`, no KV endpoints or
    quantized projections; and `pooling_spec`. `device` None means CUDA when present;
    `num_threads` None means every CPU this process may run on (CPU only).

    `execute` is not thread-safe; the engine calls it from one thread. What the engine's
    operations read of a runner is here too: an encoder runs in one process (`parallel`, the
    single-rank layout), never sleeps, and has an empty `kv_cache`.
    """

    whole_prompts = True  # each prompt is computed in the one step that carries all of it
    sleeping: frozenset[str] = frozenset()

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        device: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        self.model_dir = Path(model_dir)
        self.config: dict[str, Any] = json.loads((self.model_dir / "config.json").read_text())
        architectures = self.config.get("architectures")
        spec = pooling_spec(self.model_dir, self.config)
        if spec is None or not is_encoder(architectures):
            raise ValueError(
                f"{self.model_dir}: architectures {architectures} are no encoder this runner runs "
                f"(supported: {', '.join(sorted(ENCODER_ARCHITECTURES))})"
            )
        self.pooling_spec: PoolingSpec = spec
        self.dtype = resolve_dtype(dtype, self.device)
        self.block_size = block_size
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        limits = [self.config["max_position_embeddings"], spec.max_seq_length, max_model_len]
        self.max_model_len: int = min(limit for limit in limits if limit)
        if max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens {max_num_batched_tokens} is below max_model_len "
                f"{self.max_model_len}: an encoder runs each prompt whole in one step"
            )
        self.num_kv_blocks = 2 * (max_num_batched_tokens // block_size + max_num_seqs)
        self.vocab_size: int = self.config["vocab_size"]
        self.hidden_size: int = self.config["hidden_size"]
        self.eos_token_id: int | None = None
        self.extra_eos_token_ids: list[int] = []
        self.kv_endpoints: list[str] = []
        self.quantized_projections = 0
        self.kv_cache = torch.empty(0)
        self.parallel = parallel_state.layout()
        self.model = load_encoder(self.model_dir, self.config, self.dtype, self.device)

    @classmethod
    def from_engine_args(cls, engine_args: Mapping[str, Any], **placement: Any) -> EncoderRunner:
        """The runner an engine's arguments (`EngineArgs` as builtins, as `ModelRunner` takes
        them) ask for, its model resolved; `placement` adds `device` and `num_threads`."""
        return cls(
            resolve_model(engine_args["model"]),
            dtype=engine_args["dtype"],
            block_size=engine_args["block_size"],
            max_model_len=engine_args["max_model_len"],
            max_num_batched_tokens=engine_args["max_num_batched_tokens"],
            max_num_seqs=engine_args["max_num_seqs"],
            **placement,
        )

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, await_bitmask: Callable[[], object] | None = None
    ) -> ModelRunnerOutput:
        """Run one step: every request's pooled output, in request order.

        Each request must come whole (its `NewRequestData` with pooling parameters, all of its
        prompt, sampling) and ask for the task this model does; ValueError naming the request
        otherwise, and for a step past `max_num_batched_tokens` or `max_num_seqs`. The
        pooled outputs are float32 and raw: an embedding unnormalised, a classifier's logits
        before the activation (the engine applies both, as `pooling_spec` says).
        `await_bitmask` is never called: nothing is sampled.
        """
        if sched.num_scheduled_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{sched.num_scheduled_tokens} tokens exceed max_num_batched_tokens")
        if len(sched.requests) > self.max_num_seqs:
            raise ValueError(f"{len(sched.requests)} requests exceed max_num_seqs")
        for r in sched.requests:
            self._check(r)
        if not sched.requests:
            return ModelRunnerOutput(step=sched.step)
        input_ids, token_type_ids, mask = self._batch(sched.requests)
        out = self.model(input_ids, token_type_ids, mask)
        if self.pooling_spec.task == "embed":
            out = pool(out, mask, self.pooling_spec.pooling)
        pooled = out.float().cpu().numpy()
        results = [
            RequestStepResult(r.request_id, pooled=row)
            for r, row in zip(sched.requests, pooled, strict=True)
        ]
        return ModelRunnerOutput(step=sched.step, results=results)

    def shutdown(self) -> None:
        """Nothing runs beside the steps: there is nothing to stop."""

    def _check(self, r: ScheduledRequest) -> None:
        new = r.new
        if new is None or new.pooling_params is None:
            raise ValueError(f"{r.request_id}: not a pooling request (no pooling_params)")
        if r.num_computed_tokens or not r.sample or len(r.token_ids) != len(new.prompt_token_ids):
            raise ValueError(
                f"{r.request_id}: an encoder runs a prompt whole in one step, not "
                f"{len(r.token_ids)} of {len(new.prompt_token_ids)} tokens from "
                f"{r.num_computed_tokens}{'' if r.sample else ' without sampling'}"
            )
        if len(r.token_ids) > self.max_model_len:
            raise ValueError(
                f"{r.request_id}: {len(r.token_ids)} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        task = new.pooling_params.task
        if task != self.pooling_spec.task:
            raise ValueError(
                f"{r.request_id}: task {task!r}; this model does only {self.pooling_spec.task!r}"
            )

    def _batch(
        self, requests: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded batch: input ids, segment ids (1 from a pair's second text on), and the
        mask of real tokens, each [B, longest prompt]."""
        length = max(len(r.token_ids) for r in requests)
        input_ids = np.zeros((len(requests), length), dtype=np.int64)
        token_type_ids = np.zeros_like(input_ids)
        mask = np.zeros((len(requests), length), dtype=np.bool_)
        for i, r in enumerate(requests):
            n = len(r.token_ids)
            input_ids[i, :n] = r.token_ids
            mask[i, :n] = True
            assert r.new is not None and r.new.pooling_params is not None  # `_check`
            boundary = r.new.pooling_params.pair_boundary
            if boundary:
                token_type_ids[i, boundary:n] = 1
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(token_type_ids).to(self.device),
            torch.from_numpy(mask).to(self.device),
        )
