"""The scheduler's view of one request: its tokens, where its computation stands, and its fate.

Pure data with a few derived properties; the scheduler and the KV cache manager change it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from triode.wire.kv_seal import kv_salt
from triode.wire.messages import EngineCoreRequest, FinishReason, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from .loras import LoRAEntry


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. The FINISHED_ ones are final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its KV cache dropped; it recomputes from position 0
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # holding blocks for a prompt whose KV a KV connector is loading from another instance
    WAITING_FOR_REMOTE_KVS = 7

    @property
    def is_finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One sequence being generated.

    `num_computed_tokens` counts the tokens whose K/V the runner has been told to compute; the
    scheduler advances it when it schedules them, so a chunked prefill continues next step.
    `block_hashes` holds the chained hashes of the full blocks of `all_token_ids`; the KV cache
    manager extends it lazily, so it is never computed when prefix caching is off.

    A prompt given as embeddings keeps them (`prompt_embeds`, [prompt tokens, hidden size] of
    `prompt_embeds_dtype`) until the request ends, so a recompute after preemption has them;
    its prompt token ids are placeholders, and a digest of the embeddings starts its block
    hashes' chain (`hash_root`), so that only the same embeddings share cached blocks.
    `cache_salt` (the client's, or one the edge made from the caller's key) enters `hash_root`
    too: requests share cached blocks only when their salts are equal.

    A request run with a LoRA adapter holds its registry entry (`lora`, counted among the
    entry's `users`) from when it is queued until it leaves (`release_lora`): the adapter's
    content digest enters `hash_root`, and its name the `cache_salt` that KV-transfer seals
    bind (`kv_seal.kv_salt`).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_index",
        "eos_token_id",
        "grammar",
        "hash_root",
        "kv_load_tried",
        "kv_transfer_params",
        "kv_transfer_params_out",
        "lora",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_logprobs_sent",
        "num_prompt_tokens",
        "output_token_ids",
        "pooling_params",
        "priority",
        "prompt_embeds",
        "prompt_embeds_dtype",
        "prompt_token_ids",
        "request_id",
        "runner_knows",
        "sampling_params",
        "seq",
        "status",
        "stop_ids",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_index: int = 0,
        seq: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_embeds: np.ndarray | None = None,
        prompt_embeds_dtype: str | None = None,
        cache_salt: str | bytes | None = None,
        hash_root: bytes | None = None,
        lora: LoRAEntry | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        # Order of arrival at this scheduler: the FCFS tie-breaker. Wall-clock arrival times
        # come from several edge processes and may tie or be skewed; this counter cannot.
        self.seq = seq
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        # looked up for every token: a set, however many ids the request names
        self.stop_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1: not yet
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        # Set once the runner got the NewRequestData; it stays set across preemptions, since
        # the runner keeps a request's state until the id is in `finished_request_ids`.
        self.runner_knows = False
        # Prompt positions 1..k whose logprobs went out already, so a recompute after
        # preemption does not send them twice.
        self.num_prompt_logprobs_sent = 0
        # the KV connector's: the request's params, whether a load was tried (it is tried
        # once; a failure recomputes), and the params its finish hands on
        self.kv_transfer_params = kv_transfer_params
        self.kv_load_tried = False
        self.kv_transfer_params_out: dict[str, Any] | None = None
        # the structured-output matcher (`structured_output.Grammar`) of a constrained request
        self.grammar: Any = None
        self.prompt_embeds = prompt_embeds
        self.prompt_embeds_dtype = prompt_embeds_dtype
        self.cache_salt = cache_salt
        # What the first block's hash chains from in place of the process's NONE_HASH.
        self.hash_root = hash_root
        self.lora = lora
        if lora is not None:
            lora.users += 1
        # a pooling request: it ends with its prompt's step, its pooled output in place of a token
        self.pooling_params = pooling_params

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        seq: int,
        prompt_embeds: np.ndarray | None = None,
        hash_root: bytes | None = None,
        lora: LoRAEntry | None = None,
    ) -> Request:
        """The scheduler's request for `request`, with its embeddings, copied out of shared
        memory, when its prompt came as those, the root of its block-hash chain, and the
        LoRA adapter it runs with."""
        handle = request.prompt_embeds
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            client_index=request.client_index,
            seq=seq,
            kv_transfer_params=request.kv_transfer_params,
            prompt_embeds=prompt_embeds,
            prompt_embeds_dtype=None if handle is None else handle.dtype,
            cache_salt=kv_salt(request.cache_salt, None if lora is None else lora.name),
            hash_root=hash_root,
            lora=lora,
            pooling_params=request.pooling_params,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower is served first and preempted last: priority, then arrival."""
        return (self.priority, self.seq)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def lora_id(self) -> int:
        """The id every rank holds the request's adapter under; 0: the base model."""
        return 0 if self.lora is None else self.lora.lora_id

    def release_lora(self) -> None:
        """The request leaves: it no longer holds its adapter's entry. Idempotent."""
        if self.lora is not None:
            self.lora.users -= 1
            self.lora = None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
