"""The model runner: one `SchedulerOutput` in, one forward pass, one `ModelRunnerOutput` out.

It owns the model, the paged KV cache and each request's sampling state. Every step runs ONE
forward over the flattened batch of all scheduled tokens (prefill chunks and decodes together),
projects to logits only the rows that sample or want prompt logprobs, and samples.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

from triode.wire import (
    KVConnectorOutput,
    Logprobs,
    ModelRunnerOutput,
    RequestStepResult,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
)

from . import cpu_kernels, int4, kv_memory, kv_sizing, parallel_state
from .batch import Batch, flatten, prompt_embeds
from .cpu_paths import (
    cpu_weight_packing_supported,
    pack_cpu_weights,
    row_invariant_from,
    share_row_paths,
    use_fused_ops,
)
from .decode_stack import DecodeStack
from .dtypes import resolve_dtype
from .kv.connector import FinishedTransfers, KVConnectorWorker
from .loader import resolve_model
from .lora.config import lora_config_of
from .lora.store import LoraStore, start_lora_step
from .model_files import context_limit, eos_token_ids
from .models.llama import head_dim, parameter_defaults
from .models.registry import model_class
from .sampler import Sampler, compute_logprobs
from .sampling_state import SamplingState
from .step_sampling import Drawn, draw, logit_rows
from .stored_weights import attach_stored, load_checkpoint

# the most rows steps with prompt tokens pad their dense products to (see
# cpu_paths.RowPaths.dense_min and row_invariant_from)
DENSE_MIN_ROWS = 64
# the most prompt rows a step sends through the AMX 4-bit kernel (see cpu_paths.RowPaths.wide);
# measured on SmolLM2's projections, 2 cores: as fast as oneDNN's bfloat16 products at 256
# rows with a quarter of the weight bytes, 1.3x slower at 2048
WIDE_MAX_PROMPT_ROWS = 256

# prompt positions whose logits exist at once: 256 x a 49k vocabulary is 50 MB of float32
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState | None  # on the rank that samples (`ParallelLayout.is_driver`)
    next_prompt_logprob: int = 1  # prompt logprob rows before this one were already returned
    embeds_dtype: str | None = None  # a prompt given as embeddings: their dtype
    lora_id: int = 0  # its LoRA adapter (`LoraStore`); 0: the base model
    pooling: bool = False  # a pooling request: its last prompt row is its output


class ModelRunner:
    """Runs a Llama-family model from a Hugging Face directory over a paged KV cache.

    What the scheduler sizes itself by: `num_kv_blocks` blocks of `block_size` tokens (as many
    as `kv_cache_memory` bytes hold over all layers), `max_model_len`, `eos_token_id` (and
    `extra_eos_token_ids`, the model's other end-of-sequence ids), `vocab_size`; and `dtype`,
    `device` as resolved. `quantization` "auto" runs the projections and the LM head a
    GGUF file as it stores them (`gguf_file`, `quant_matmul`) where this device has a kernel
    for them; "dense-head" the projections only; "none" runs the dequantized weights only;
    `gguf_arithmetic` "integer" runs those that have one in the integer mode (`gguf_int8.c`).
    `device` None means CUDA when present; `num_threads` None means every CPU this process may
    run on (CPU only). `lora_config` (None: LoRA off) sets the limits of the LoRA adapters
    kept in `lora` (`LoraStore`). `enable_expert_parallel` splits a mixture of
    experts' experts over the TP group instead of each expert (`parallel_state.expert_parallel`).

    In a parallel world (`parallel_state`) the runner holds this rank's shard of its pipeline
    stage: every rank runs `execute` on the same `SchedulerOutput`; a later stage receives the
    previous stage's hidden states and residual, an earlier one sends them on, and only the
    driver rank (TP rank 0 of the last stage) samples and returns results; the others return an
    empty `ModelRunnerOutput`. Every rank's KV cache takes the world's smallest block count, so
    all have the scheduler's geometry.

    `execute` is not thread-safe; the engine calls it from one thread.
    """

    whole_prompts = False  # prompts may be chunked: their KV stays in the cache between steps

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        gguf_arithmetic: str = "exact",
        kv_cache_memory: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        seed: int = 0,
        device: str | None = None,
        num_threads: int | None = None,
        kv_transfer_config: dict[str, Any] | None = None,
        lora_config: dict[str, Any] | None = None,
        enable_expert_parallel: bool = False,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.parallel = parallel_state.layout()
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.dtype = resolve_dtype(dtype, self.device)
        self.block_size = block_size
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len = context_limit(self.config, max_model_len)
        self._max_model_len_given = max_model_len is not None  # never lowered to fit the cache
        self.vocab_size: int = self.config.vocab_size
        self.hidden_size: int = self.config.hidden_size
        eos = eos_token_ids(self.model_dir, self.config)
        self.eos_token_id: int | None = eos[0] if eos else None
        self.extra_eos_token_ids = eos[1:]

        self.quantization, self.integer = quantization, gguf_arithmetic == "integer"
        self.enable_expert_parallel = enable_expert_parallel
        # what steps with prompt rows pad dense products to: oneDNN's bfloat16 products are
        # where a row's result may depend on the row count (`row_invariant_from`, at load)
        bfloat16_cpu = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self._dense_min: int | None = None if bfloat16_cpu else 0
        # what may not run now (`sleep`): "kv_cache", "weights"; a step refuses while any does
        self.sleeping: frozenset[str] = frozenset()
        self.kv_cache = torch.empty(0)  # allocated once the model says its geometry
        self.lora = None if lora_config is None else LoraStore(lora_config, self.dtype, self.device)
        self.load_model(self.model_dir)
        self.kv_connector: KVConnectorWorker | None = None
        if kv_transfer_config is not None:
            self.kv_connector = KVConnectorWorker(kv_transfer_config, self.parallel.rank)
        self.num_kv_blocks = self._allocate_kv_cache(kv_cache_memory)
        # each rank's KV server, in rank order (every rank takes part in the gather)
        self.kv_endpoints: list[str] = []
        self._transfers = FinishedTransfers(self.parallel.world_size)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_cache)
            endpoints = parallel_state.all_gather(self.kv_connector.endpoint, str | None)
            self.kv_endpoints = [e for e in endpoints if e is not None]
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self.pooling_spec: Any = None  # set when the model is served for embeddings (`runners`)

    def load_model(self, weights_dir: Path) -> None:
        """Build the model and load its weights from `weights_dir` (a checkpoint of this
        runner's config): at start, and again on waking from a sleep that freed the weights.

        The weights are packed for the CPU where that is faster, the 4-bit codes that
        `weights_dir` keeps attached, the kernels bound, and the KV cache's views given to the
        new attention layers.
        """
        with (
            parameter_defaults(self.dtype, self.device),
            parallel_state.expert_parallel(self.enable_expert_parallel),
            torch.no_grad(),
        ):
            model = model_class(self.config)(self.config, max_position=self.max_model_len)
            # raising, it keeps the old model
            count = load_checkpoint(
                model, weights_dir, self.dtype, self._stored_kernels(), self.integer
            )
            self.model = model
            self.pack_weights()
            self.quantized_projections = count
        self._row_paths = share_row_paths(self.model)
        if self._dense_min is None:
            self._dense_min = row_invariant_from(self.model, DENSE_MIN_ROWS)
        if self.lora is not None:  # the resident adapters' pairs reach the new projections
            self.lora.share(self.model)
        self.model.eval()
        # decode attention from the paged cache in place, where the C kernel is built (CPU,
        # bfloat16 or float32)
        kernel = None
        if self.device.type == "cpu" and self.dtype in cpu_kernels.FUSED_DTYPES:
            attn = self.model.model.stage_layers[0].self_attn.attn
            kernel = cpu_kernels.paged_decode_attention_for(
                attn.num_heads, attn.num_kv_heads, attn.head_dim
            )
        self.paged_kernel = kernel is not None
        for layer in self.model.model.stage_layers:
            layer.self_attn.attn.paged_kernel = kernel
        # and the operations between the projections, fused, on the same terms
        ops = None
        if self.device.type == "cpu" and self.dtype in cpu_kernels.FUSED_DTYPES:
            ops = cpu_kernels.fused_ops()
        use_fused_ops(self.model, ops)
        self._fused = ops
        # decode-only steps' layers in one C call where the model and kernels allow
        self.model.model.decode_stack = (
            DecodeStack.for_model(self.model.model) if ops is not None else None
        )
        self.bind_kv_cache()

    def pack_weights(self) -> int:
        """Pack the projections not packed yet for oneDNN where this CPU gains from it (see
        `cpu_paths`); returns how many were packed."""
        if self.device.type == "cpu" and cpu_weight_packing_supported(self.dtype):
            with torch.no_grad():
                return pack_cpu_weights(self.model)
        return 0

    def attach_quantized(self, weights_dir: Path) -> int:
        """`stored_weights.attach_stored` for this runner's model (an update from disk)."""
        kernels = self._stored_kernels()
        return attach_stored(self.model, weights_dir, self.dtype, kernels, self.integer)

    def _stored_kernels(self) -> str | None:
        """The quantization stored weights run under on this device ("auto", "dense-head"), or
        None where they do not (asked for "none", or no kernel for this dtype and device)."""
        if self.quantization == "none" or not int4.kernel_available(self.dtype, self.device):
            return None
        return self.quantization

    @classmethod
    def from_engine_args(cls, engine_args: Mapping[str, Any], **placement: Any) -> ModelRunner:
        """The runner an engine's arguments (`EngineArgs` as builtins: every field present)
        ask for, its model resolved; `placement` adds `device` and `num_threads`."""
        return cls(
            resolve_model(engine_args["model"]),
            dtype=engine_args["dtype"],
            quantization=engine_args["quantization"],
            gguf_arithmetic=engine_args["gguf_arithmetic"],
            kv_cache_memory=int(engine_args["kv_cache_memory"]),
            block_size=engine_args["block_size"],
            max_model_len=engine_args["max_model_len"],
            max_num_batched_tokens=engine_args["max_num_batched_tokens"],
            max_num_seqs=engine_args["max_num_seqs"],
            seed=engine_args["seed"],
            kv_transfer_config=engine_args.get("kv_transfer_config"),
            lora_config=lora_config_of(engine_args),
            enable_expert_parallel=engine_args["enable_expert_parallel"],
            **placement,
        )

    def _allocate_kv_cache(self, memory: int) -> int:
        """Allocate this rank's KV cache, fit `max_model_len` to it: `kv_sizing.size_kv_cache`."""
        layers = [layer.self_attn.attn for layer in self.model.model.stage_layers]
        dims = (len(layers), layers[0].num_kv_heads, head_dim(self.config), self.dtype.itemsize)
        limits = (memory, self.max_model_len, self._max_model_len_given, self.max_num_seqs)
        num_blocks, self.max_model_len = kv_sizing.size_kv_cache(
            kv_sizing.KVGeometry(*dims, self.block_size),
            kv_sizing.KVLimits(*limits),
            self.device,
            self.parallel,
            lambda value: parallel_state.world_min(value, self.device),
        )
        # zeros, not empty: padded reads must see finite values, or 0 * NaN poisons attention
        shape = (len(layers), 2, num_blocks, self.block_size, *dims[1:3])
        if self.kv_connector is not None:
            self.kv_cache = self.kv_connector.allocate(shape, self.dtype, self.device)
        else:
            lazy = memory == kv_sizing.AUTO
            self.kv_cache = kv_memory.zeroed(shape, self.dtype, self.device, lazy=lazy)
        self.bind_kv_cache()
        return num_blocks

    def bind_kv_cache(self) -> None:
        """Give every attention layer of this stage its views of the KV cache (none while the
        cache is unallocated or asleep)."""
        for i, layer in enumerate(self.model.model.stage_layers):
            attn = layer.self_attn.attn
            if self.kv_cache.numel():
                attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            else:
                attn.k_cache = attn.v_cache = torch.empty(0)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, await_bitmask: Callable[[], object] | None = None
    ) -> ModelRunnerOutput:
        """Run one step. Raises KeyError for a request scheduled without ever being announced.

        A step with constrained rows carries their grammar bitmask, or it is being filled on
        another thread: then `await_bitmask` waits for it, and the runner calls it only once the
        logits are computed, so the fill overlaps the forward.

        With a KV connector, the step's metadata is bound before the forward and, when it asks,
        every rank's finished transfers are gathered after it (a collective, so every rank
        takes part) and the driver reports those every rank is through with.
        """
        metadata = sched.kv_connector_metadata
        connector = self.kv_connector
        if connector is None or metadata is None:
            return self._execute(sched, await_bitmask)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv()
        try:
            output = self._execute(sched, await_bitmask)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        self._transfers.forget(metadata.release)
        if metadata.sync:
            reports = parallel_state.all_gather(connector.get_finished(), KVConnectorOutput)
            finished = self._transfers.add(reports)
            if self.parallel.is_driver:
                output.kv_connector_output = finished
        return output

    def _execute(
        self, sched: SchedulerOutput, await_bitmask: Callable[[], object] | None
    ) -> ModelRunnerOutput:
        for request_id in sched.finished_request_ids:
            self._requests.pop(request_id, None)
        for r in sched.requests:
            if r.new is not None:
                prompt, params = r.new.prompt_token_ids, r.new.sampling_params
                embeds_dtype = r.new.prompt_embeds_dtype
                state = None
                if self.parallel.is_driver:
                    # placeholder ids are no tokens that a repetition penalty could count
                    known = [] if embeds_dtype is not None else prompt
                    state = SamplingState(params, known, self.eos_token_id, self.vocab_size)
                self._requests[r.request_id] = _Request(
                    prompt,
                    params,
                    state,
                    embeds_dtype=embeds_dtype,
                    lora_id=r.new.lora_id,
                    pooling=r.new.pooling_params is not None,
                )
        if sched.num_scheduled_tokens > self.max_num_batched_tokens:
            raise ValueError(f"{sched.num_scheduled_tokens} tokens exceed max_num_batched_tokens")
        if len(sched.requests) > self.max_num_seqs:
            raise ValueError(f"{len(sched.requests)} requests exceed max_num_seqs")
        for r in sched.requests:
            if r.num_draft_tokens and not (0 < r.num_draft_tokens < len(r.token_ids) and r.sample):
                raise ValueError(
                    f"{r.request_id}: {r.num_draft_tokens} proposals in a chunk of "
                    f"{len(r.token_ids)} tokens that {'samples' if r.sample else 'does not sample'}"
                )
        if not sched.requests:
            return ModelRunnerOutput(step=sched.step)
        if self.sleeping:
            asleep = " and ".join(sorted(self.sleeping))
            raise RuntimeError(f"a step came while the {asleep} sleep: wake_up first")

        batch = self._prepare(sched.requests)
        start_lora_step(self.lora, batch.lora_runs)
        decodes = batch.meta.num_decodes  # the leading rows (see cpu_paths.RowPaths)
        self._row_paths.decodes = decodes
        prompt_rows = any(
            r.num_computed_tokens < len(self._requests[r.request_id].prompt_token_ids)
            for r in sched.requests
        )
        self._row_paths.dense_min = (self._dense_min or 0) if prompt_rows else 0
        # the AMX 4-bit kernel for a step's rows past torch's, unless many prompt rows came
        # at once: oneDNN's dense products are faster from a few hundred rows on
        self._row_paths.wide = len(batch.input_ids) - decodes <= WIDE_MAX_PROMPT_ROWS
        hidden = self._forward(batch)
        if hidden is None:  # an earlier pipeline stage: the next one carries on
            return ModelRunnerOutput(step=sched.step)

        pools = {r.request_id for r in sched.requests if self._requests[r.request_id].pooling}
        sampling = [r for r in sched.requests if r.sample and r.request_id not in pools]
        tokens: dict[str, Drawn] = {}
        if sampling:
            rows = logit_rows(sampling, batch.start)
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            if logits is not None:
                states = [self._state(r.request_id) for r in sampling]
                drawn = draw(
                    logits, sampling, states, sched, self.sampler, self._fused, await_bitmask
                )
                tokens = dict(zip((r.request_id for r in sampling), drawn, strict=True))
        results = []
        for r in sched.requests:
            result = RequestStepResult(r.request_id)
            if r.request_id in tokens:
                emitted, result.logprobs = tokens[r.request_id]
                *result.accepted_token_ids, result.token_id = emitted
                state = self._state(r.request_id)
                for token_id in emitted:
                    state.append(token_id)
            span = self._prompt_logprob_span(r)
            if span is not None:
                first_position, targets = span
                first = batch.start[r.request_id] + first_position - r.num_computed_tokens
                num_top = self._requests[r.request_id].params.prompt_logprobs or 0
                result.prompt_logprobs = self._prompt_logprobs(hidden, first, targets, num_top)
            if r.sample and r.request_id in pools:  # the decoder's last-token embedding
                row = batch.start[r.request_id] + len(r.token_ids) - 1
                result.pooled = hidden[row].float().cpu().numpy()
            if (
                result.token_id is not None
                or result.prompt_logprobs is not None
                or result.pooled is not None
            ):
                results.append(result)
        if not self.parallel.is_driver:
            return ModelRunnerOutput(step=sched.step)
        return ModelRunnerOutput(step=sched.step, results=results)

    def shutdown(self) -> None:
        """Stop the KV connector's threads; the runner steps no more."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def _state(self, request_id: str) -> SamplingState:
        state = self._requests[request_id].sampling
        assert state is not None, "only the driver rank samples"
        return state

    def _forward(self, batch: Batch) -> torch.Tensor | None:
        """This stage's share of the forward pass: the last stage's hidden states, or None on
        an earlier stage once it sent its output to the next one."""
        stage = self.parallel
        intermediate = None
        if not stage.is_first_stage:
            rows, hidden_size = batch.input_ids.shape[0], self.config.hidden_size
            intermediate = parallel_state.recv_from_previous_stage(
                rows, hidden_size, self.dtype, self.device
            )
        out = self.model(batch.input_ids, batch.positions, batch.meta, intermediate, batch.embeds)
        if stage.is_last_stage:
            assert isinstance(out, torch.Tensor)
            return out
        parallel_state.send_to_next_stage(*out)
        return None

    def _prompt_logprobs(
        self, hidden: torch.Tensor, first: int, targets: list[int], num_top: int
    ) -> Logprobs | None:
        """Logprobs of `targets` under the rows of `hidden` from `first` on, a slice of rows at
        a time: a whole prompt's full-vocabulary logits at once would take hundreds of MB."""
        parts = []
        for lo in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            chunk = targets[lo : lo + PROMPT_LOGPROBS_ROWS]
            logits = self.model.compute_logits(hidden[first + lo : first + lo + len(chunk)])
            if logits is not None:  # the driver; the other TP ranks only took part
                parts.append(compute_logprobs(logits.float().cpu(), torch.tensor(chunk), num_top))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return Logprobs(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )

    def _prompt_logprob_span(self, r: ScheduledRequest) -> tuple[int, list[int]] | None:
        """(first position, target tokens) of the prompt logprobs this chunk computes.

        Position p's logits predict prompt token p + 1. Each prompt token gets its row once: a
        request recomputing its prompt after preemption does not return them again.
        """
        request = self._requests[r.request_id]
        if request.params.prompt_logprobs is None:
            return None
        prompt = request.prompt_token_ids
        end = r.num_computed_tokens + len(r.token_ids)
        lo = max(r.num_computed_tokens + 1, request.next_prompt_logprob)
        hi = min(end, len(prompt) - 1)
        if lo > hi:
            return None
        request.next_prompt_logprob = hi + 1
        return lo - 1, prompt[lo : hi + 1]

    def _prepare(self, requests: list[ScheduledRequest]) -> Batch:
        unknown = [r.request_id for r in requests if r.request_id not in self._requests]
        if unknown:
            raise KeyError(f"requests scheduled without their NewRequestData: {unknown}")
        return flatten(
            requests,
            block_size=self.block_size,
            device=self.device,
            dtype=self.dtype,
            paged_kernel=self.paged_kernel,
            embeds_of=self._embeds if self.parallel.is_first_stage else None,
            lora_of=lambda r: self._requests[r.request_id].lora_id,
        )

    def _embeds(self, r: ScheduledRequest) -> torch.Tensor:
        return prompt_embeds(r, self._requests[r.request_id].embeds_dtype, self.hidden_size)
