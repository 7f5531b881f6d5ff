"""Whether a scheduler can ever run a request: the kind of request its model serves
(`task_error`) and a prompt that fits its context and its whole KV cache (`prompt_error`). A
request that fails either is finished with the error at once: queued, it would wait forever."""

from __future__ import annotations

from triode.wire.messages import EngineCoreRequest

from .scheduler_config import SchedulerConfig


def task_error(config: SchedulerConfig, request: EngineCoreRequest) -> str | None:
    """Why the model cannot serve `request`'s kind (generation, a pooling task), if so."""
    pooling = request.pooling_params
    if pooling is None:
        return None if config.generates else "this model serves pooling requests only"
    if pooling.task not in config.pooling_tasks:
        served = ", ".join(sorted(config.pooling_tasks)) or "none: it generates text"
        return f"this model does not serve the pooling task {pooling.task!r} (it serves {served})"
    if request.sampling_params.structured_outputs is not None or request.kv_transfer_params:
        return "a pooling request takes no structured outputs or kv_transfer_params"
    if config.whole_prompts and len(request.prompt_token_ids) > config.max_num_batched_tokens:
        return (
            f"the prompt has {len(request.prompt_token_ids)} tokens; this encoder computes a "
            f"prompt in one step of at most {config.max_num_batched_tokens} "
            "(max_num_batched_tokens)"
        )
    return None


def prompt_error(config: SchedulerConfig, max_len: int, request: EngineCoreRequest) -> str | None:
    """Why `request`'s prompt never fits: a generating request needs room for one token past
    it, in the model's context (`max_model_len`) and in the whole cache (`max_len`); a pooling
    one only for its prompt."""
    num_prompt = len(request.prompt_token_ids)
    pooling = request.pooling_params is not None
    needed = num_prompt if pooling else num_prompt + 1
    if needed > config.max_model_len:
        if pooling:
            return (
                f"the prompt has {num_prompt} tokens, but the model's context length is "
                f"{config.max_model_len}"
            )
        return (
            f"the prompt has {num_prompt} tokens, but the model's context length is "
            f"{config.max_model_len} and at least one token must be generated"
        )
    if needed > max_len:
        blocks = -(-needed // config.block_size)
        purpose = "for it" if pooling else "to generate one token"
        return (
            f"the prompt has {num_prompt} tokens and needs {blocks} KV cache blocks {purpose}, "
            f"but the whole cache has {config.num_blocks}"
        )
    return None
