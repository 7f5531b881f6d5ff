"""The request bodies of the OpenAI endpoints served here (chat, completions, tokenize,
detokenize), as msgspec Structs, and their decoding.

Ranges are checked at decode, and every failure becomes a 400 naming the field. Top-level fields
triode does not know are accepted and ignored, as vLLM does, and named in the response
(`edge/ignored_fields.py`); nested objects are strict. Fields of OpenAI's, vLLM's and the routers'
APIs that triode does not implement are declared, so a client that sends them as null or as their
default never trips; `unsupported()` refuses the ones set to something that would change the
answer.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
from msgspec import Meta

from triode.wire.messages import MAX_SAMPLING_SCALE

from ..errors import APIError
from ..http import Request
from ..ignored_fields import decode_request_body

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


# Values of refused fields that ask for nothing beyond what triode does.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
}


class _Body(msgspec.Struct, kw_only=True):
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
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_SAMPLING_SCALE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: (
        Annotated[float, Meta(ge=1 / MAX_SAMPLING_SCALE, le=MAX_SAMPLING_SCALE)] | None
    ) = None
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
    # vLLM's: the prompt's and the generated token ids in the answer; logprobs' tokens named
    # `token_id:{id}` rather than by their text
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # What vllm-router writes into every body it forwards (SGLang's names): `no_stop_trim`
    # keeps the stop string in the output, as `include_stop_str_in_output` does; without a
    # reasoning parser there is no reasoning to separate, so the other two change nothing.
    no_stop_trim: bool = False
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    # Accepted and ignored: they do not change the answer.
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    length_penalty: Any = None
    # Structured output (see edge/completions/structured.py).
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
    vllm_xargs: Any = None
    return_hidden_states: bool | None = None

    _REFUSED = {
        "return_hidden_states": "returning hidden states",
        "use_beam_search": "beam search",
        "truncate_prompt_tokens": "prompt truncation",
        "bad_words": "bad_words",
        "logits_processors": "custom logits processors",
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
    # Tool calling (see edge/tools/choice.py and edge/tools/calls.py).
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
    prompt given as embeddings (`edge/completions/prompt_embeds.py`). With them `prompt` may be
    left out, null or empty; prompts from both run embeddings first.
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


def decode_request(body: bytes, kind: type[_RequestT], http: Request | None = None) -> _RequestT:
    """Decode and validate a JSON body; any failure raises a 400 `APIError` naming the field.
    The top-level fields it ignored are announced on `http`'s response."""
    request = decode_request_body(body, kind, http)
    request.unsupported()
    return request


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")
