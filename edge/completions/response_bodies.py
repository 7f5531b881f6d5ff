"""The response bodies of the OpenAI endpoints served here (chat, completions, models,
tokenize, detokenize), as msgspec Structs: every field is encoded, with OpenAI's names and
`object` values.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec


def _now() -> int:
    return int(time.time())


class PromptTokenUsageInfo(msgspec.Struct, kw_only=True):
    cached_tokens: int | None = None


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class ChatCompletionLogProb(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(msgspec.Struct, kw_only=True):
    content: list[ChatCompletionLogProbsContent] | None = None


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's shape for one candidate at a prompt position, keyed by its token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatCompletionResponseChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # the generated ids, with `return_token_ids`


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None  # with `return_token_ids`
    weight_version: int = 0  # of the weights that made the last tokens


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = []


class ChatCompletionResponseStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # the delta's ids, with `return_token_ids`


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunks, with `return_token_ids`
    weight_version: int = 0


class CompletionLogProbs(msgspec.Struct, kw_only=True):
    # Parallel lists, one entry per token; the first prompt token has no logprob (None).
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionResponseChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    # with `return_token_ids`: the prompt's ids and the generated ones (not the echo's)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    weight_version: int = 0  # of the weights that made the last tokens


class CompletionResponseStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with `return_token_ids`: the prompt's ids on a choice's first chunk, the delta's ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    weight_version: int = 0


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "triode"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    weight_version: int = 0  # 0: the weights the engine started with; one more per update


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str
