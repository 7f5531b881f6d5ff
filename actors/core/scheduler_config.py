"""The limits one scheduler works within (`SchedulerConfig`): its KV cache's size and block
size, how many requests and tokens a step takes, how much new prompt a step starts, the
context length, and how many requests may wait to start.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # prompt tokens that a step's new requests start with, the first one's whatever it takes
    # (0: no limit but the budget)
    max_new_prompt_tokens: int = 0
    max_model_len: int
    enable_prefix_caching: bool = True
    # requests that may wait to start; one past it is refused, to be retried (0: no bound)
    max_waiting_requests: int = 0
    # what pooling requests the model runs ("embed", "classify"; `PoolingParams.task`), and
    # whether it generates at all: a model served for pooling takes no other requests
    pooling_tasks: frozenset[str] = frozenset()
    generates: bool = True
    # an encoder (bidirectional attention, no KV cache) computes each prompt in one step
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_new_prompt_tokens < 0:
            raise ValueError("max_new_prompt_tokens must be >= 0")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.whole_prompts and self.enable_prefix_caching:
            raise ValueError("whole_prompts (an encoder, no KV cache) needs prefix caching off")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
