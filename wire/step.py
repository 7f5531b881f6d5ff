"""What the scheduler hands the model runner each step, and what comes back.

The runner keeps per-request state (sampling parameters, seeded generator, output history for
penalties) from the first time it sees a request until the request id appears in
`finished_request_ids`. These messages cross a process boundary when the model runs in worker
processes (tensor/pipeline parallelism), so they are wire messages like the rest.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np

from .kv_transfer import KVConnectorMetadata, KVConnectorOutput
from .messages import _HOT, Logprobs, PoolingParams, SamplingParams


class NewRequestData(msgspec.Struct, **_HOT):
    """Sent with a request the first time the runner sees it."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Set when the prompt came as embeddings (its token ids are placeholders): their dtype,
    # which each chunk's `ScheduledRequest.prompt_embeds` rows are in.
    prompt_embeds_dtype: str | None = None
    # The LoRA adapter the request runs with: the id the engine core loaded it on every rank
    # under (`add_lora`); 0 is the base model.
    lora_id: int = 0
    # a pooling request: the runner pools its prompt's hidden states where it would sample
    pooling_params: PoolingParams | None = None


class ScheduledRequest(msgspec.Struct, **_HOT):
    """One request's share of a step.

    The runner computes `token_ids` at positions `num_computed_tokens ..
    num_computed_tokens + len(token_ids) - 1`, writing their K/V into the blocks of `block_ids`
    (the request's whole block table: position p lives in block `block_ids[p // block_size]`,
    slot `p % block_size`). When `sample` is set, the chunk ends at the last known token and the
    runner samples the next one from the logits of the last position.

    A speculating request's `token_ids` end with `num_draft_tokens` proposed tokens past its
    last known one (speculative decoding): the runner computes their K/V like any other, takes
    the logits of the last known position and of every proposal, and keeps the longest run of
    proposals the model agrees with (`RequestStepResult.accepted_token_ids`) and one token of
    its own after them. The K/V it wrote for rejected proposals is stale: the scheduler
    computes those positions again.

    For a prompt given as embeddings, `prompt_embeds` holds the rows [rows, hidden size] of the
    chunk's first `rows` positions, those in the prompt: the runner uses them in place of the
    embedding lookup of `token_ids` there. They are in the request's `prompt_embeds_dtype`,
    bfloat16 as its uint16 bits.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool = True
    new: NewRequestData | None = None
    prompt_embeds: np.ndarray | None = None
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        """The proposals this step verifies: the last `num_draft_tokens` of `token_ids`."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


class SchedulerOutput(msgspec.Struct, **_HOT):
    step: int
    requests: list[ScheduledRequest] = []
    finished_request_ids: list[str] = []  # the runner forgets their state
    kv_connector_metadata: KVConnectorMetadata | None = None  # with a KV connector only
    # Structured output: row i of the packed int32 bitmask [n, ceil(vocab / 32)] allows the
    # next tokens of `grammar_request_ids[i]` (bit t of the row: token t). A speculating
    # request has 1 + `num_draft_tokens` rows in a row, one per verified position: what its
    # grammar allows after the known tokens, then after each proposal in turn.
    grammar_request_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


class RequestStepResult(msgspec.Struct, **_HOT):
    """What one step produced for one request.

    `token_id` is None when the request did not sample this step (a prefill chunk that does not
    reach the end of the prompt). `logprobs` has one row, for the sampled token, when the
    request asked for logprobs. `prompt_logprobs` has a row per prompt position whose logprob
    this step computed: the row for prompt token i (i >= 1) is conditioned on tokens < i.

    A speculating request's step produces `accepted_token_ids` (the proposals the model
    agreed with), then `token_id`; its `logprobs` then has a row for each of those tokens, in
    that order.
    """

    request_id: str
    token_id: int | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    accepted_token_ids: list[int] = []
    # a pooling request's output (float32 [dimensions]) from the step that ends its prompt,
    # in place of a token
    pooled: np.ndarray | None = None


class ModelRunnerOutput(msgspec.Struct, **_HOT):
    """Results in the order of `SchedulerOutput.requests`, only for requests that sampled or
    computed prompt logprobs.

    `protocol_errors` counts, from a worker's start, the broadcast messages it could not decode
    (from the rank that answers; every rank reads the same bytes).
    """

    step: int
    results: list[RequestStepResult] = []
    protocol_errors: int = 0
    kv_connector_output: KVConnectorOutput | None = None  # when the step's metadata asked


class WorkerMessageType(enum.Enum):
    """The one-byte first frame of every message the executor broadcasts to its workers."""

    EXECUTE = b"\x00"  # then a SchedulerOutput
    SHUTDOWN = b"\x01"  # leave the step loop; nothing follows
    CALL = b"\x02"  # then a WorkerCall (`operations.py`); every rank answers a WorkerReply
