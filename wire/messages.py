"""Engine protocol messages: what travels edge -> engine core and engine core -> edges.

Hot messages are `array_like`, `omit_defaults`, `gc=False` msgspec Structs. Fields evolve by
appending with defaults; never reorder or remove one.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
import numpy as np

from .tensor_ipc import TensorHandle

_HOT = {"array_like": True, "omit_defaults": True, "gc": False}

# Largest seed accepted; matches the int64 range torch generators take.
_MAX_SEED = 2**63 - 1
# the largest temperature and repetition penalty, and the reciprocal of the smallest penalty:
# the sampler holds them as float32 and scales by them what is under 2**27 in size (logits, an
# Exp(1) draw's log), which stays finite then; past float32's range one is infinite, and the
# -inf that disallows a token (allowed_token_ids, a grammar's mask) turns NaN in its product,
# which the sampler's argmax takes
MAX_SAMPLING_SCALE = 2.0**100

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]

# Caps on what one request may ask for, each far above ordinary use (OpenAI takes 4 stop
# strings and 300 logit_bias entries; vLLM caps neither): a stop string is searched for in the
# new text of every step, and the held-back tail of a stream is as long as the longest one.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 256
MAX_LOGIT_BIAS = 300

# Longest `EngineCoreRequest.cache_salt`: room for a client's salt and a key digest the edge
# adds to it, with a margin; the salt is hashed once per request, so the bound is about memory.
MAX_WIRE_CACHE_SALT = 1024

# Longest LoRA adapter name (`EngineCoreRequest.lora_name`): served names are short; the bound
# keeps a request's lookup key small.
MAX_LORA_NAME = 256


class EngineCoreRequestType(enum.Enum):
    """The one-byte first frame of every message on the input socket."""

    ADD_REQUEST = b"\x00"
    ABORT_REQUEST = b"\x01"
    UTILITY = b"\x02"


class FinishReason(enum.IntEnum):
    """Why a request ended; an int on the wire for compactness."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    # not taken for now (the engine core's queue is full): the same request may succeed later
    REFUSED = 4

    def __str__(self) -> str:
        return self.name.lower()


class StructuredOutputsParams(msgspec.Struct, **_HOT):
    """A constraint on a request's output: exactly one of the fields is set.

    `json` is a JSON schema (as JSON text, so equal schemas compare equal as strings);
    `grammar` is Lark, or GBNF when it contains `::=`; `json_object` asks for any JSON object.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        chosen = [
            self.json is not None,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
            self.json_object,
        ]
        _check(sum(chosen) == 1, "structured_outputs", "exactly one constraint must be set")
        _check(
            self.choice is None or (bool(self.choice) and all(self.choice)),
            "choice",
            "must be a non-empty list of non-empty strings",
        )


class SamplingParams(msgspec.Struct, **_HOT):
    """How to pick tokens for one request. Validated on construction and on decode."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # One chained test on the hot path (NaN fails every comparison); the field-by-field
        # checks only run to name what is wrong.
        if not (
            1 <= self.n <= 128
            and 0.0 <= self.temperature <= MAX_SAMPLING_SCALE
            and 0.0 < self.top_p <= 1.0
            and self.top_k >= 0
            and 0.0 <= self.min_p <= 1.0
            and (self.seed is None or -_MAX_SEED <= self.seed <= _MAX_SEED)
            and -2.0 <= self.presence_penalty <= 2.0
            and -2.0 <= self.frequency_penalty <= 2.0
            and 1 / MAX_SAMPLING_SCALE <= self.repetition_penalty <= MAX_SAMPLING_SCALE
            and (self.max_tokens is None or self.max_tokens >= 1)
            and 0 <= self.min_tokens
            and (self.max_tokens is None or self.min_tokens <= self.max_tokens)
            and (self.logprobs is None or 0 <= self.logprobs <= 20)
            and (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20)
            and (not self.stop or _valid_stop(self.stop))
            and (not self.stop_token_ids or min(self.stop_token_ids) >= 0)
            and (self.logit_bias is None or _valid_bias(self.logit_bias))
            and (
                self.allowed_token_ids is None
                or (bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0)
            )
        ):
            self._explain()
        # Each id once: with ids below the vocabulary size (checked where the model is known),
        # the lists are then no longer than the vocabulary, whatever the request sent.
        if len(self.stop_token_ids) > 1:
            self.stop_token_ids = _unique(self.stop_token_ids)
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > 1:
            self.allowed_token_ids = _unique(self.allowed_token_ids)

    def _explain(self) -> None:
        _check(1 <= self.n <= 128, "n", "must be between 1 and 128")
        _check(0 <= self.temperature <= MAX_SAMPLING_SCALE, "temperature", "must be in [0, 2**100]")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.seed is None or -_MAX_SEED <= self.seed <= _MAX_SEED, "seed", "out of range")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(
            1 / MAX_SAMPLING_SCALE <= self.repetition_penalty <= MAX_SAMPLING_SCALE,
            "repetition_penalty",
            "must be in [2**-100, 2**100]",
        )
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be <= max_tokens",
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be in [0, 20]",
        )
        _check(all(self.stop), "stop", "must not contain empty strings")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, not {len(self.stop)}",
        )
        _check(
            all(len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop),
            "stop",
            f"a stop string may be at most {MAX_STOP_STRING_LENGTH} characters long",
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(
            self.logit_bias is None or len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} entries, not {len(self.logit_bias or ())}",
        )
        _check(
            self.logit_bias is None or _valid_bias(self.logit_bias),
            "logit_bias",
            "token ids must be >= 0 and biases in [-100, 100]",
        )
        _check(
            self.allowed_token_ids is None
            or (bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0),
            "allowed_token_ids",
            "must be a non-empty list of token ids",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class PoolingParams(msgspec.Struct, **_HOT):
    """What makes a request a pooling one (embeddings, scores): its prompt is computed in full
    and the model's pooled output comes back in place of generated tokens; nothing is sampled
    and no KV is kept for it after its step.

    `task` is "embed" (the pooled hidden state, as the model's pooling says) or "classify"
    (a classification head's logits: a cross-encoder's score). `pair_boundary` is where the
    second text of a pair starts in the prompt (its segment ids are 1 from there on); 0: one
    text.
    """

    task: str = "embed"
    pair_boundary: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0

    def __post_init__(self) -> None:
        _check(self.task in ("embed", "classify"), "task", 'must be "embed" or "classify"')


class EngineCoreRequest(msgspec.Struct, **_HOT):
    """A tokenized request, ready for the scheduler."""

    request_id: str
    # Checked element-wise by the decoder, in C; a sender that builds requests in Python
    # validates token ids where they enter (the intake).
    prompt_token_ids: list[TokenId]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    client_index: int = 0
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt as embeddings [len(prompt_token_ids), hidden size] in shared memory, in place
    # of the embedding lookup; its token ids are then placeholders (zeros).
    prompt_embeds: TensorHandle | None = None
    # Mixed into the hash of the prompt's first KV block, so that only requests with the same
    # salt share cached prefix blocks (vLLM's `cache_salt`; the edge may fold in the caller's
    # key digest).
    cache_salt: str | None = None
    # The LoRA adapter the request runs with, by the name the engine core registered it under
    # (None: the base model). The engine core resolves it when the request arrives.
    lora_name: str | None = None
    # Set for a pooling request (`PoolingParams`): no tokens are generated for it.
    pooling_params: PoolingParams | None = None

    def __post_init__(self) -> None:
        _check(bool(self.request_id), "request_id", "must not be empty")
        _check(bool(self.prompt_token_ids), "prompt_token_ids", "must not be empty")
        _check(0 <= self.client_index < 2**16, "client_index", "must fit in 16 bits")
        _check(
            self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_WIRE_CACHE_SALT,
            "cache_salt",
            f"must be a non-empty string of at most {MAX_WIRE_CACHE_SALT} characters",
        )
        _check(
            self.lora_name is None or 0 < len(self.lora_name) <= MAX_LORA_NAME,
            "lora_name",
            f"must be a non-empty string of at most {MAX_LORA_NAME} characters",
        )


class Logprobs(msgspec.Struct, **_HOT):
    """Log-probabilities for a run of positions.

    Row i describes position i: column 0 is the chosen (or prompt) token, columns 1.. the top-k
    alternatives in descending order. `ranks[i]` is the chosen token's rank in the full vocabulary
    (1 = most likely).
    """

    token_ids: np.ndarray  # int32 [positions, 1 + k]
    logprobs: np.ndarray  # float32 [positions, 1 + k]
    ranks: np.ndarray  # int32 [positions]

    def __post_init__(self) -> None:
        _check(
            self.token_ids.dtype == np.int32
            and self.ranks.dtype == np.int32
            and self.logprobs.dtype == np.float32,
            "logprobs",
            "token_ids and ranks must be int32, logprobs float32",
        )
        _check(
            self.token_ids.ndim == 2
            and self.logprobs.shape == self.token_ids.shape
            and self.ranks.shape == self.token_ids.shape[:1],
            "logprobs",
            "token_ids, logprobs and ranks disagree in shape",
        )


class EngineCoreOutput(msgspec.Struct, **_HOT):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    # which weights made these tokens: 0 those the engine started with, then one more per
    # weight update (`OperationError`-free `finish_weight_update`, `update_weights_from_disk`)
    weight_version: int = 0
    # a pooling request's result (float32 [dimensions]), with its finish
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, **_HOT):
    """A snapshot of the scheduler after a step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # 0-1; cached-but-free blocks count as free
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # the KV connector's (disaggregated prefill); the token counters are cumulative
    num_loading_reqs: int = 0  # waiting for their prompt's KV from another instance
    num_held_reqs: int = 0  # finished, their blocks kept for another instance to read
    prompt_tokens_computed: int = 0  # prompt positions this instance's forward computed
    prompt_tokens_transferred: int = 0  # prompt positions loaded from another instance
    kv_load_failures: int = 0  # loads that failed or timed out (the prompt recomputed)
    kv_protocol_errors: int = 0  # KV transfer messages refused as malformed
    # kv_transfer_params refused: not sealed by this deployment, altered, expired, or made for
    # another prompt (the request computed its prompt, or held no blocks)
    kv_params_refused: int = 0


class UtilityCall(msgspec.Struct, **_HOT):
    """An RPC to the engine core; its result rides the output socket as a `UtilityOutput`."""

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0


class UtilityOutput(msgspec.Struct, **_HOT):
    call_id: int
    failure_message: str | None = None
    result: Any = None
    # how an operation refused (`operations.OperationErrorKind`); None for any other failure
    failure_kind: str | None = None


class EngineCoreOutputs(msgspec.Struct, **_HOT):
    """Everything one engine step sends to one client (one PUB topic).

    `seq` counts messages per topic from 0, so a subscriber detects a gap.
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    seq: int = 0
    timestamp: float = 0.0


def _valid_bias(bias: dict[int, float]) -> bool:
    return len(bias) <= MAX_LOGIT_BIAS and all(
        t >= 0 and -100.0 <= b <= 100.0 for t, b in bias.items()
    )


def _valid_stop(stop: list[str]) -> bool:
    return len(stop) <= MAX_STOP_STRINGS and all(0 < len(s) <= MAX_STOP_STRING_LENGTH for s in stop)


def _unique(ids: list[int]) -> list[int]:
    """`ids` without repeats, in first-seen order (the list itself when it has none)."""
    once = list(dict.fromkeys(ids))
    return ids if len(once) == len(ids) else once


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")
