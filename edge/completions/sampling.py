"""How a chat or completions request becomes the engine's `SamplingParams`: its fields
translated, the model's defaults where it leaves one unset, its token budget fitted to the
context window, and every bound a 400 naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triode.wire import SamplingParams, StructuredOutputsParams
from triode.wire.messages import MAX_LOGIT_BIAS

from ..errors import APIError, validation_error
from .request_bodies import ChatCompletionRequest, CompletionRequest

_MAX_TOKEN_ID = 2**31  # token ids are below this, on the wire and in every vocabulary


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    structured_outputs: StructuredOutputsParams | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The engine's sampling parameters for `req`, whose prompt is `prompt_len` tokens long.

    `defaults` (the engine's `generation_defaults`: the model's generation config, as vLLM
    takes it) fill temperature, top_p, top_k, min_p, repetition_penalty and max_tokens where
    `req` leaves them unset; vLLM's neutral values fill the rest.

    Raises a 400 `APIError` when the prompt, or the prompt with the tokens asked for, does not fit
    in `max_model_len`, or when the parameters do not validate.
    """
    if isinstance(req, ChatCompletionRequest):
        where = "messages"
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        where, max_tokens, param, logprobs = "prompt", req.max_tokens, "max_tokens", req.logprobs
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{limit} However, your request has {prompt_len} input tokens. Please reduce the"
            f" length of the {where}.",
            param=where,
        )
    defaults = defaults or {}
    if max_tokens is None:
        max_tokens = min(max_model_len - prompt_len, defaults.get("max_tokens") or max_model_len)
    elif prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"{limit} However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the"
            f" {where}, {max_tokens} in the completion). Please reduce the length of the {where}"
            " or completion.",
            param=param,
        )
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = logprobs
    try:
        return SamplingParams(
            n=req.n or 1,
            temperature=_given(req.temperature, defaults, "temperature", 1.0),
            top_p=_given(req.top_p, defaults, "top_p", 1.0),
            top_k=_top_k(_given(req.top_k, defaults, "top_k", 0)),
            min_p=_given(req.min_p, defaults, "min_p", 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_given(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
        )
    except ValueError as e:
        raise validation_error(e) from e


def _given(value: Any, defaults: Mapping[str, Any], name: str, neutral: Any) -> Any:
    """The request's `value`; where it left it unset, the model's default, else vLLM's."""
    return value if value is not None else defaults.get(name, neutral)


def _top_k(top_k: int | None) -> int:
    # -1 and 0 are off, and so is a top_k that no vocabulary reaches (as in the sampler); an
    # arbitrarily large one would not even fit the engine's wire encoding.
    return top_k if top_k is not None and 0 < top_k < _MAX_TOKEN_ID else 0


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS:  # before converting the keys of a body-sized dict
        raise APIError(
            400,
            f"logit_bias: at most {MAX_LOGIT_BIAS} entries, not {len(bias)}",
            param="logit_bias",
        )
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(
            400, "logit_bias: keys must be token ids (integers as strings)", param="logit_bias"
        ) from None
