"""The OpenAI API's request and response bodies, as msgspec Structs.

Requests are strict: unknown fields are refused, ranges are checked at decode, and every failure
becomes a 400 naming the field. Fields of OpenAI's and vLLM's APIs that triode does not implement
are still accepted, so a client that sends them as null or as their default never trips;
`unsupported()` refuses the ones set to something that would change the answer. Responses encode
every field, with OpenAI's names and `object` values.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
from msgspec import Meta

from triode.edge.errors import APIError, validation_error
from triode.wire import SamplingParams, StructuredOutputsParams
from triode.wire.messages import MAX_LOGIT_BIAS

_MAX_TOKEN_ID = 2**31  # token ids are below this, on the wire and in every vocabulary
_TokenId = Annotated[int, Meta(ge=0)]
_Count = Annotated[int, Meta(ge=1)]
_N = Annotated[int, Meta(ge=1, le=128)]
_NumLogprobs = Annotated[int, Meta(ge=0, le=20)]
_Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# No vocabulary has more ids (Gemma 3's is 2**18): a longer list of them is refused as it is
# decoded, before a repeat is looked for in it
_TokenIds = Annotated[list[_TokenId], Meta(max_length=1 << 18)]
# Longest `cache_salt` a client may send: vLLM's is unbounded; a salt names a tenant or a
# session, and 256 characters leaves room for any such name or a digest of one.
MAX_CACHE_SALT = 256
_CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)]


# Requests

# Values of refused fields that ask for nothing beyond what triode does.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
}


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Field -> the feature it asks for; the request is refused when the field is set.
    _REFUSED: ClassVar[dict[str, str]] = {}

    def unsupported(self) -> None:
        """Raise a 400 `APIError` naming the first field set to a feature triode lacks."""
        for name, feature in self._REFUSED.items():
            value = getattr(self, name)
            if value not in (None, False, [], {}) and value not in _ACCEPTED.get(name, ()):
                raise APIError(400, f"{name}: {feature} is not supported", param=name)


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    audio_url: Any = None
    video_url: Any = None
    file: Any = None
    refusal: str | None = None
    prompt_cache_breakpoint: Any = None

    def __post_init__(self) -> None:
        _check(self.type == "text", "type", f"only text content is supported, not {self.type!r}")
        _check(self.text is not None, "text", "a text part needs its text")


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: Any = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None


class _GenerationRequest(_Body, kw_only=True):
    # What chat and completions share: the model, how to sample, and how to answer.
    model: str | None = None
    n: _N | None = None
    max_tokens: _Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: _TokenIds | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: _TokenIds | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: _NumLogprobs | None = None
    echo: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # Only requests with the same salt share cached prefix blocks (vLLM's field).
    cache_salt: _CacheSalt | None = None
    # Accepted and ignored: they do not change the answer.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    length_penalty: Any = None
    # Structured output (see edge/structured.py).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: str | None = None  # accepted and ignored: triode has one engine
    # Accepted, refused when set (see `unsupported`).
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    vllm_xargs: Any = None

    _REFUSED = {
        "use_beam_search": "beam search",
        "truncate_prompt_tokens": "prompt truncation",
        "bad_words": "bad_words",
        "logits_processors": "custom logits processors",
        "return_tokens_as_token_ids": "return_tokens_as_token_ids",
        "return_token_ids": "return_token_ids",
        "vllm_xargs": "vllm_xargs",
    }

    def _check_common(self) -> None:
        _check(
            self.stream_options is None or bool(self.stream),
            "stream_options",
            "only allowed when stream is true",
        )


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """A `POST /v1/chat/completions` body."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: _Count | None = None
    logprobs: bool | None = False
    top_logprobs: _NumLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    include_reasoning: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    # Tool calling (see edge/tools.py and edge/tool_calls.py).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Accepted, refused when set (see `unsupported`).
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    _REFUSED = {
        **_GenerationRequest._REFUSED,
        "functions": "function calling",
        "function_call": "function calling",
        "modalities": "output other than text",
        "audio": "audio output",
        "prediction": "predicted outputs",
        "web_search_options": "web search",
        "moderation": "moderation",
        "chat_template": "a chat template in the request",
        "mm_processor_kwargs": "multimodal input",
    }

    def __post_init__(self) -> None:
        self._check_common()
        _check(
            not self.top_logprobs or bool(self.logprobs),
            "top_logprobs",
            "logprobs must be true to use top_logprobs",
        )
        _check(
            not (self.continue_final_message and self.add_generation_prompt),
            "continue_final_message",
            "cannot be combined with add_generation_prompt",
        )


class CompletionRequest(_GenerationRequest, kw_only=True):
    """A `POST /v1/completions` body.

    `prompt_embeds` (vLLM's): base64 of a `torch.save`d tensor, or a list of them, each one
    prompt given as embeddings (`edge/prompt_embeds.py`). With them `prompt` may be left out,
    null or empty; prompts from both run embeddings first.
    """

    prompt: str | list[str | _TokenId | list[_TokenId]] | None = None
    max_tokens: _Count | None = 16
    logprobs: _NumLogprobs | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None

    _REFUSED = {
        **_GenerationRequest._REFUSED,
        "suffix": "suffix (insertion)",
    }

    def __post_init__(self) -> None:
        self._check_common()
        embeds = self.prompt_embeds
        if embeds is not None:
            parts = embeds if isinstance(embeds, list) else [embeds]
            _check(bool(parts) and all(parts), "prompt_embeds", "must not be empty")
            if self.prompt in ("", []):
                self.prompt = None  # the openai client must send a prompt: "" stands for none
            if self.prompt is None:
                return
        _check(self.prompt is not None, "prompt", "give a prompt, prompt_embeds or both")
        prompt = self.prompt
        kinds = {type(p) for p in prompt} if isinstance(prompt, list) else {str}
        _check(
            len(kinds) <= 1,
            "prompt",
            "must be a string, a list of strings, a list of token ids or a list of those lists",
        )
        parts = prompt if isinstance(prompt, list) else [prompt]
        _check(
            bool(parts) and all(isinstance(p, int) or p for p in parts),
            "prompt",
            "must not be empty",
        )

    def unsupported(self) -> None:
        super().unsupported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of: must be null or equal to n", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts to complete, one choice set each: texts or token id lists (those after
        the prompts given as embeddings, `embeds_prompts`)."""
        prompt = self.prompt
        if prompt is None:
            return []
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]

    def embeds_prompts(self) -> list[str]:
        """The base64 payloads of the prompts given as embeddings."""
        embeds = self.prompt_embeds
        if embeds is None:
            return []
        return [embeds] if isinstance(embeds, str) else embeds


class TokenizeRequest(_Body, kw_only=True):
    """A `POST /tokenize` body: a `prompt`, or chat `messages` to render first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def __post_init__(self) -> None:
        _check(
            (self.prompt is None) != (self.messages is None),
            "prompt",
            "give either prompt or messages",
        )
        _check(
            not (self.continue_final_message and self.add_generation_prompt),
            "continue_final_message",
            "cannot be combined with add_generation_prompt",
        )
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None


class DetokenizeRequest(_Body, kw_only=True):
    """A `POST /detokenize` body."""

    tokens: list[_TokenId]
    model: str | None = None


_RequestT = TypeVar("_RequestT", bound=_Body)


def decode_request(body: bytes, kind: type[_RequestT]) -> _RequestT:
    """Decode and validate a JSON body; any failure raises a 400 `APIError` naming the field."""
    try:
        request = _decoder(kind).decode(body)
    except (msgspec.DecodeError, ValueError) as e:
        raise validation_error(e) from e
    except RecursionError:  # msgspec's limit on nesting in `Any` fields
        raise APIError(400, "invalid JSON: nested too deeply") from None
    request.unsupported()
    return request


@functools.cache
def _decoder(kind: type[_RequestT]) -> msgspec.json.Decoder[_RequestT]:
    return msgspec.json.Decoder(kind)


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's sampling parameters for `req`, whose prompt is `prompt_len` tokens long.

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
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
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
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=_top_k(req.top_k),
            min_p=req.min_p or 0.0,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if req.repetition_penalty is None else req.repetition_penalty),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
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


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")


# Responses


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


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


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


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionResponseStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "triode"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


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
