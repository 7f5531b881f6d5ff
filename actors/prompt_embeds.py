"""Prompts given as embeddings: what they must look like, and both ends of their way through
shared memory (`triode.wire.tensor_ipc`).

The engine shares the tensor once per child request (`share_prompt_embeds`) and unlinks each
segment when its `generate` ends; the engine core copies the rows out and unlinks the segment
as soon as the request arrives (`receive_prompt_embeds`). Either side alone cleans up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from triode.wire import EngineCoreRequest, ProtocolError
from triode.wire.tensor_ipc import SharedTensor, TensorHandle, open_shared, share

DTYPES = ("float32", "bfloat16", "float16")
# bfloat16's exponent bits: all set is an infinity or a NaN
_BF16_EXPONENT = 0x7F80


def check_prompt_embeds(dtype: str, shape: Sequence[int], hidden_size: int) -> None:
    """Raise ValueError unless `shape` is [positions >= 1, `hidden_size`] of a float dtype
    (`hidden_size` 0: any)."""
    if dtype not in DTYPES:
        raise ValueError(f"prompt_embeds: dtype must be one of {', '.join(DTYPES)}, not {dtype}")
    if len(shape) != 2:
        raise ValueError(f"prompt_embeds: must be [positions, hidden size], not {list(shape)}")
    if shape[0] < 1:
        raise ValueError("prompt_embeds: must hold at least one position")
    if hidden_size and shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds: rows of {shape[1]} values, but the model's hidden size is "
            f"{hidden_size}"
        )


def describe_prompt_embeds(embeds: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a numpy array, a torch tensor or a `TensorHandle`."""
    dtype = str(getattr(embeds, "dtype", "")).removeprefix("torch.")
    return dtype, tuple(getattr(embeds, "shape", ()))


def share_prompt_embeds(embeds: Any, copies: int) -> list[tuple[TensorHandle, SharedTensor]]:
    """One segment per child request (each engine core unlinks its own on receipt) holding
    `embeds`, which `check_prompt_embeds` has passed: a numpy array (float32, float16), a CPU
    torch tensor (those and bfloat16), or a `TensorHandle` already shared, which this takes
    over (the caller unlinks it if this raises).

    Raises ValueError for a handle whose segment is not there, and OSError when shared memory
    has no room; nothing this made stays shared then."""
    if isinstance(embeds, TensorHandle):
        if copies == 1:
            return [(embeds, SharedTensor(embeds))]
        try:
            embeds = open_shared(embeds, unlink=True)
        except ProtocolError as e:
            raise ValueError(f"prompt_embeds: {e}") from None
    dtype, _ = describe_prompt_embeds(embeds)
    shared: list[tuple[TensorHandle, SharedTensor]] = []
    try:
        for _ in range(copies):
            shared.append(share(embeds, dtype=dtype))
    except BaseException:
        for _, owner in shared:
            owner.unlink()
        raise
    return shared


def receive_prompt_embeds(handle: TensorHandle, hidden_size: int) -> np.ndarray:
    """The engine core's end: the embeddings copied out of shared memory, whose segment is
    then unlinked whatever happened. Raises ValueError for a missing or malformed segment,
    embeddings of the wrong shape or dtype, and values that are not finite."""
    try:
        embeds = open_shared(handle, unlink=True)
    except ProtocolError as e:
        raise ValueError(f"prompt_embeds: {e}") from None
    check_prompt_embeds(handle.dtype, embeds.shape, hidden_size)
    if handle.dtype == "bfloat16":
        finite = not np.any(embeds & _BF16_EXPONENT == _BF16_EXPONENT)
    else:
        finite = bool(np.isfinite(embeds).all())
    if not finite:
        raise ValueError("prompt_embeds: holds values that are not finite")
    return embeds


def embeds_error(request: EngineCoreRequest, prompt_embeds: np.ndarray | None) -> str | None:
    """Why a request and its prompt embeddings (received: `receive_prompt_embeds`) do not go
    together in the scheduler, or None."""
    if (request.prompt_embeds is None) != (prompt_embeds is None):
        return "prompt_embeds: the request and its embeddings must come together"
    if prompt_embeds is None:
        return None
    if len(prompt_embeds) != len(request.prompt_token_ids):
        return (
            f"prompt_embeds: {len(prompt_embeds)} rows for {len(request.prompt_token_ids)} "
            "prompt positions"
        )
    if request.sampling_params.prompt_logprobs is not None:
        return "prompt_logprobs: not supported for a prompt given as embeddings"
    if request.kv_transfer_params:
        return "kv_transfer_params: not supported for a prompt given as embeddings"
    return None
