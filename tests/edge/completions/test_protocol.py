"""The OpenAI request and response schemas: what decodes, what is refused, what clients parse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import msgspec
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from triode.edge.completions.request_bodies import (
    MAX_CACHE_SALT,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode_request,
)
from triode.edge.completions.response_bodies import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokenUsageInfo,
    TokenizeResponse,
    UsageInfo,
)
from triode.edge.completions.sampling import sampling_params
from triode.edge.errors import APIError

USER = {"role": "user", "content": "Hello"}


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _chat(**fields: Any) -> ChatCompletionRequest:
    return decode_request(_body(**{"messages": [USER], **fields}), ChatCompletionRequest)


def _completion(**fields: Any) -> CompletionRequest:
    return decode_request(_body(**{"prompt": "Once", **fields}), CompletionRequest)


def _client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    transport = httpx2.MockTransport(handler)
    return openai.OpenAI(
        api_key="key",
        base_url="http://triode.test/v1",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )


def _sse(*events: msgspec.Struct) -> bytes:
    chunks = [b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events]
    return b"".join(chunks) + b"data: [DONE]\n\n"


# What the openai client sends decodes, and what we answer it parses.


def test_openai_client_chat_request_decodes_and_its_answer_parses() -> None:
    seen: list[ChatCompletionRequest] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        req = decode_request(request.content, ChatCompletionRequest)
        seen.append(req)
        choice = ChatCompletionResponseChoice(
            index=0, message=ChatMessageOut(content="Hi!"), finish_reason="stop"
        )
        usage = UsageInfo(prompt_tokens=7, completion_tokens=2, total_tokens=9)
        answer = ChatCompletionResponse(id="chatcmpl-1", model="m", choices=[choice], usage=usage)
        return httpx2.Response(200, content=msgspec.json.encode(answer))

    completion = _client(handler).chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "assistant", "content": "Hi.", "name": "bot"},
            {"role": "developer", "content": "Still brief."},
        ],
        max_tokens=5,
        max_completion_tokens=6,
        n=2,
        stop="\n",
        temperature=0.5,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"42": -100},
        logprobs=True,
        top_logprobs=3,
        user="someone",
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=False,
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        reasoning_effort="low",
        modalities=["text"],
        prompt_cache_key="cache",
        safety_identifier="id",
        verbosity="low",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )

    req = seen[0]
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "developer"]
    assert (req.max_tokens, req.max_completion_tokens, req.n, req.stop) == (5, 6, 2, "\n")
    assert (req.top_k, req.min_p, req.repetition_penalty, req.ignore_eos) == (5, 0.05, 1.1, True)
    assert req.logit_bias == {"42": -100}
    assert completion.choices[0].message.content == "Hi!"
    assert completion.usage is not None and completion.usage.total_tokens == 9


def test_openai_client_chat_stream_parses_our_chunks() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        req = decode_request(request.content, ChatCompletionRequest)
        assert req.stream and req.stream_options is not None and req.stream_options.include_usage

        def chunk(
            delta: DeltaMessage, finish: str | None = None, usage: UsageInfo | None = None
        ) -> ChatCompletionStreamResponse:
            choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish)
            choices = [] if usage else [choice]
            return ChatCompletionStreamResponse(
                id="chatcmpl-2", model="m", choices=choices, usage=usage
            )

        body = _sse(
            chunk(DeltaMessage(role="assistant", content="")),
            chunk(DeltaMessage(content="Hel")),
            chunk(DeltaMessage(content="lo"), finish="length"),
            chunk(DeltaMessage(), usage=UsageInfo(prompt_tokens=3, completion_tokens=2)),
        )
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    stream = _client(handler).chat.completions.create(
        model="m", messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_openai_client_completion_request_decodes_and_its_answer_parses() -> None:
    seen: list[CompletionRequest] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        req = decode_request(request.content, CompletionRequest)
        seen.append(req)
        logprobs = CompletionLogProbs(
            text_offset=[0, 5],
            token_logprobs=[-0.5, -1.5],
            tokens=["Once", " upon"],
            top_logprobs=[{"Once": -0.5}, {" upon": -1.5, " more": -2.0}],
        )
        choice = CompletionResponseChoice(
            index=0, text=" upon", logprobs=logprobs, finish_reason="length"
        )
        usage = UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        answer = CompletionResponse(id="cmpl-1", model="m", choices=[choice], usage=usage)
        return httpx2.Response(200, content=msgspec.json.encode(answer))

    completion = _client(handler).completions.create(
        model="m",
        prompt=[[1, 2, 3], [4, 5]],
        best_of=2,
        n=2,
        echo=True,
        logprobs=2,
        max_tokens=1,
        stop=["."],
        seed=3,
        suffix=None,
        user="someone",
    )

    req = seen[0]
    assert req.prompts() == [[1, 2, 3], [4, 5]]
    assert (req.best_of, req.n, req.echo, req.logprobs) == (2, 2, True, 2)
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.top_logprobs == [
        {"Once": -0.5},
        {" upon": -1.5, " more": -2.0},
    ]


def test_openai_client_completion_stream_parses_our_chunks() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        decode_request(request.content, CompletionRequest)
        body = _sse(
            CompletionStreamResponse(
                id="cmpl-2", model="m", choices=[CompletionResponseStreamChoice(index=0, text="a")]
            ),
            CompletionStreamResponse(
                id="cmpl-2",
                model="m",
                choices=[CompletionResponseStreamChoice(index=0, text="b", finish_reason="stop")],
            ),
        )
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    chunks = list(_client(handler).completions.create(model="m", prompt="x", stream=True))

    assert [c.choices[0].text for c in chunks] == ["a", "b"]
    assert chunks[-1].choices[0].finish_reason == "stop"


# Requests built by hand.


def test_explicit_nulls_decode_as_unset() -> None:
    nulls = dict.fromkeys(
        [
            "model", "n", "max_tokens", "max_completion_tokens", "stop", "temperature", "top_p",
            "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
            "top_logprobs", "user", "stream", "stream_options", "tools", "tool_choice",
            "response_format", "functions", "function_call", "audio", "prediction",
        ]
    )  # fmt: skip
    req = _chat(**nulls)
    params = sampling_params(req, prompt_len=10, max_model_len=100)
    assert (params.n, params.temperature, params.max_tokens, params.logprobs) == (1, 1.0, 90, None)


def test_completion_prompt_forms() -> None:
    assert _completion(prompt="a b").prompts() == ["a b"]
    assert _completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert _completion(prompt=[0, 5, 7]).prompts() == [[0, 5, 7]]
    assert _completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_message_content_parts_and_tool_history_decode() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = _chat(
        messages=[
            {"role": "user", "content": parts},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    decoded = req.messages[0].content
    assert isinstance(decoded, list)
    assert [(p.type, p.text) for p in decoded] == [("text", "a"), ("text", "b")]
    assert req.messages[1].content is None
    assert req.messages[2].tool_call_id == "c1"


def test_tokenize_request_takes_a_prompt_or_messages() -> None:
    by_prompt = decode_request(_body(prompt="hi"), TokenizeRequest)
    by_chat = decode_request(_body(messages=[USER], model="m"), TokenizeRequest)
    assert (by_prompt.add_special_tokens, by_chat.add_special_tokens) == (True, False)
    assert by_chat.add_generation_prompt
    detok = decode_request(_body(tokens=[1, 2], model="m"), DetokenizeRequest)
    assert detok.tokens == [1, 2]


# Every refusal is a 400 that names its field.

CHAT_ERRORS = [
    (b"{", None),
    (b"[]", None),
    (_body(messages=[]), "messages"),
    (_body(model="m"), "messages"),
    (_body(messages=[USER], temperature="hot"), "temperature"),
    (_body(messages=[USER], stream="yes"), "stream"),
    (_body(messages=[{**USER, "unknown_field": 1}]), "messages[0].unknown_field"),
    (_body(messages=[USER], max_tokens=-1), "max_tokens"),
    (_body(messages=[USER], max_tokens=0), "max_tokens"),
    (_body(messages=[USER], max_completion_tokens=0), "max_completion_tokens"),
    (_body(messages=[USER], top_p=2), "top_p"),
    (_body(messages=[USER], top_p=0), "top_p"),
    (_body(messages=[USER], temperature=-1), "temperature"),
    (_body(messages=[USER], temperature=1e39), "temperature"),  # infinite in float32
    (_body(messages=[USER], repetition_penalty=1e-300), "repetition_penalty"),
    (_body(messages=[USER], n=1e9), "n"),
    (_body(messages=[USER], n=1_000_000_000), "n"),
    (_body(messages=[USER], n=0), "n"),
    (_body(messages=[USER], presence_penalty=3), "presence_penalty"),
    (_body(messages=[USER], top_k=-2), "top_k"),
    (_body(messages=[USER], min_p=1.5), "min_p"),
    (_body(messages=[USER], logprobs=True, top_logprobs=1000), "top_logprobs"),
    (_body(messages=[USER], top_logprobs=2), "top_logprobs"),
    (_body(messages=[USER], stop_token_ids=[-1]), "stop_token_ids[0]"),
    (_body(messages=[USER], stream_options={"include_usage": True}), "stream_options"),
    (_body(messages=[USER], stream=True, stream_options={"x": 1}), "stream_options.x"),
    (_body(messages=[USER], continue_final_message=True), "continue_final_message"),
    (_body(messages=[{"role": "bot", "content": "x"}]), "messages[0].role"),
    (_body(messages=[{"content": "x"}]), "messages[0].role"),
    (_body(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (_body(messages=[{"role": "user", "content": "x", "extra": 1}]), "messages[0].extra"),
    (
        _body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].type",
    ),
    (
        _body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (_body(messages=[USER], modalities=["text", "audio"]), "modalities"),
    (_body(messages=[USER], use_beam_search=True), "use_beam_search"),
    (_body(messages=[USER], chat_template="{{ 1 }}"), "chat_template"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_ERRORS)
def test_bad_chat_request_is_a_400_naming_its_field(body: bytes, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        decode_request(body, ChatCompletionRequest)
    assert info.value.status == 400
    assert info.value.param == param
    if param is not None:
        assert info.value.message.startswith(f"{param}: ")


COMPLETION_ERRORS = [
    (_body(), "prompt"),
    (_body(prompt=None), "prompt"),
    (_body(prompt=""), "prompt"),
    (_body(prompt=[]), "prompt"),
    (_body(prompt=[[1], []]), "prompt"),
    (_body(prompt=["a", 1]), "prompt"),
    (_body(prompt=[1.5]), "prompt[0]"),
    (_body(prompt=[-1]), "prompt[0]"),
    (_body(prompt="x", logprobs=1000), "logprobs"),
    (_body(prompt="x", logprobs=True), "logprobs"),
    (_body(prompt="x", suffix="y"), "suffix"),
    (_body(prompt="x", best_of=3, n=2), "best_of"),
    (_body(prompt="x", max_tokens=-1), "max_tokens"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_ERRORS)
def test_bad_completion_request_is_a_400_naming_its_field(body: bytes, param: str) -> None:
    with pytest.raises(APIError) as info:
        decode_request(body, CompletionRequest)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        (_body(), TokenizeRequest, "prompt"),
        (_body(prompt="a", messages=[USER]), TokenizeRequest, "prompt"),
        (_body(prompt=3), TokenizeRequest, "prompt"),
        (_body(tokens=[1, -2]), DetokenizeRequest, "tokens[1]"),
        (_body(tokens="1 2"), DetokenizeRequest, "tokens"),
    ],
)
def test_bad_tokenizer_request_is_a_400_naming_its_field(
    body: bytes, kind: type[TokenizeRequest | DetokenizeRequest], param: str
) -> None:
    with pytest.raises(APIError) as info:
        decode_request(body, kind)
    assert (info.value.status, info.value.param) == (400, param)


def test_accepted_values_of_unimplemented_features_pass() -> None:
    _chat(response_format={"type": "text"}, tool_choice="auto", tools=[], modalities=["text"])
    _chat(use_beam_search=False, parallel_tool_calls=True, store=True, reasoning_effort="high")
    _completion(best_of=2, n=2)


# From a request to the engine's SamplingParams.


def test_chat_defaults_fill_the_context_window() -> None:
    params = sampling_params(_chat(), prompt_len=30, max_model_len=2048)
    assert params.max_tokens == 2018
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert (params.logprobs, params.prompt_logprobs, params.stop) == (None, None, [])


def test_completion_max_tokens_defaults_to_16() -> None:
    assert sampling_params(_completion(), prompt_len=3, max_model_len=2048).max_tokens == 16


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = _chat(max_tokens=5, max_completion_tokens=9)
    assert sampling_params(req, prompt_len=1, max_model_len=100).max_tokens == 9


def test_request_fields_map_onto_sampling_params() -> None:
    req = _chat(
        n=3, temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=11, stop="END",
        stop_token_ids=[2], presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.2,
        min_tokens=2, max_tokens=8, ignore_eos=True, include_stop_str_in_output=True,
        skip_special_tokens=False, logit_bias={"5": 10.5, "7": -100}, allowed_token_ids=[5, 7],
    )  # fmt: skip
    params = sampling_params(req, prompt_len=4, max_model_len=64)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (3, 0.0, 0.5, 0)
    assert (params.min_p, params.seed, params.stop, params.stop_token_ids) == (
        0.1,
        11,
        ["END"],
        [2],
    )
    assert (params.presence_penalty, params.frequency_penalty) == (1.0, -1.0)
    assert (params.repetition_penalty, params.min_tokens, params.max_tokens) == (1.2, 2, 8)
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert params.logit_bias == {5: 10.5, 7: -100.0}
    assert params.allowed_token_ids == [5, 7]


@pytest.mark.parametrize(
    ("fields", "logprobs", "prompt_logprobs"),
    [
        ({"logprobs": True}, 0, None),
        ({"logprobs": True, "top_logprobs": 4}, 4, None),
        ({"logprobs": False, "top_logprobs": 0}, None, None),
        ({"logprobs": True, "top_logprobs": 2, "echo": True}, 2, 2),
        ({"prompt_logprobs": 3}, None, 3),
    ],
)
def test_chat_logprobs_map_to_top_k(
    fields: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None
) -> None:
    params = sampling_params(_chat(**fields), prompt_len=1, max_model_len=10)
    assert (params.logprobs, params.prompt_logprobs) == (logprobs, prompt_logprobs)


@pytest.mark.parametrize(
    ("fields", "logprobs", "prompt_logprobs"),
    [
        ({"logprobs": 0}, 0, None),
        ({"logprobs": 5}, 5, None),
        ({"logprobs": 5, "echo": True}, 5, 5),
        ({"echo": True}, None, None),
    ],
)
def test_completion_logprobs_map_to_top_k(
    fields: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None
) -> None:
    params = sampling_params(_completion(**fields), prompt_len=1, max_model_len=100)
    assert (params.logprobs, params.prompt_logprobs) == (logprobs, prompt_logprobs)


def test_too_many_tokens_asked_is_a_400_on_max_tokens() -> None:
    with pytest.raises(APIError) as info:
        sampling_params(_chat(max_tokens=100), prompt_len=30, max_model_len=120)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert info.value.message.startswith(
        "This model's maximum context length is 120 tokens. However, you requested 130 tokens"
        " (30 in the messages, 100 in the completion)."
    )


def test_too_many_completion_tokens_names_max_completion_tokens() -> None:
    with pytest.raises(APIError) as info:
        sampling_params(_chat(max_completion_tokens=100), prompt_len=30, max_model_len=120)
    assert info.value.param == "max_completion_tokens"


@pytest.mark.parametrize(("make", "param"), [(_chat, "messages"), (_completion, "prompt")])
def test_prompt_that_fills_the_window_is_a_400(
    make: Callable[[], ChatCompletionRequest | CompletionRequest], param: str
) -> None:
    with pytest.raises(APIError) as info:
        sampling_params(make(), prompt_len=120, max_model_len=120)
    assert (info.value.status, info.value.param) == (400, param)
    assert "your request has 120 input tokens" in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_sampling_values_the_engine_refuses_are_400s(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        sampling_params(_chat(**fields), prompt_len=1, max_model_len=100)
    assert (info.value.status, info.value.param) == (400, param)


# Responses parse as the openai client's own types.


def _usage() -> UsageInfo:
    cached = PromptTokenUsageInfo(cached_tokens=4)
    return UsageInfo(
        prompt_tokens=5, completion_tokens=2, total_tokens=7, prompt_tokens_details=cached
    )


def test_chat_response_with_logprobs_parses_as_chat_completion() -> None:
    top = [ChatCompletionLogProb(token="Hi", logprob=-0.1, bytes=[72, 105])]
    content = ChatCompletionLogProbsContent(
        token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=top
    )
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessageOut(content="Hi"),
        logprobs=ChatCompletionLogProbs(content=[content]),
        finish_reason="stop",
    )
    response = ChatCompletionResponse(id="c", model="m", choices=[choice], usage=_usage())

    parsed = ChatCompletion.model_validate_json(msgspec.json.encode(response))

    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.content
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].bytes == [72, 105]
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_chat_chunk_parses_as_chat_completion_chunk() -> None:
    choice = ChatCompletionResponseStreamChoice(
        index=1, delta=DeltaMessage(role="assistant", content="x"), finish_reason="length"
    )
    chunk = ChatCompletionStreamResponse(id="c", model="m", choices=[choice], usage=_usage())

    parsed = ChatCompletionChunk.model_validate_json(msgspec.json.encode(chunk))

    assert parsed.object == "chat.completion.chunk"
    assert (parsed.choices[0].index, parsed.choices[0].delta.content) == (1, "x")


def test_completion_response_and_chunk_parse_as_completion() -> None:
    logprobs = CompletionLogProbs(
        text_offset=[0], token_logprobs=[-0.2], tokens=["a"], top_logprobs=[{"a": -0.2}]
    )
    choice = CompletionResponseChoice(index=0, text="a", logprobs=logprobs, finish_reason="stop")
    response = CompletionResponse(id="c", model="m", choices=[choice], usage=_usage())
    last = CompletionResponseStreamChoice(index=0, text="a", finish_reason="length")
    chunk = CompletionStreamResponse(id="c", model="m", choices=[last])

    parsed = Completion.model_validate_json(msgspec.json.encode(response))
    parsed_chunk = Completion.model_validate_json(msgspec.json.encode(chunk))

    assert parsed.object == "text_completion"
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.tokens == ["a"]
    assert parsed_chunk.choices[0].text == "a"


def test_model_list_parses_as_openai_models() -> None:
    listing = ModelList(data=[ModelCard(id="smol", root="/models/smol", max_model_len=2048)])
    raw = json.loads(msgspec.json.encode(listing))

    models = [Model.model_validate(card) for card in raw["data"]]

    assert raw["object"] == "list"
    assert (models[0].id, models[0].object, models[0].owned_by) == ("smol", "model", "triode")
    assert raw["data"][0]["max_model_len"] == 2048


def test_tokenizer_responses_encode_every_field() -> None:
    tokenized = json.loads(
        msgspec.json.encode(TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2]))
    )
    assert tokenized == {"count": 2, "max_model_len": 8, "tokens": [1, 2], "token_strs": None}
    assert json.loads(msgspec.json.encode(DetokenizeResponse(prompt="hi"))) == {"prompt": "hi"}


# cache_salt


@pytest.mark.parametrize("decode", [_chat, _completion])
def test_cache_salt_is_a_bounded_non_empty_string_or_a_400_naming_it(
    decode: Callable[..., Any],
) -> None:
    # Any caller of the generation routes sends it; the largest taken (256 characters, and the
    # key isolation's 68 more) is hashed once per request in the engine core, which refuses
    # more than 1024 on the wire.
    assert decode().cache_salt is None
    assert decode(cache_salt="tenant-7").cache_salt == "tenant-7"
    assert decode(cache_salt="x" * MAX_CACHE_SALT).cache_salt == "x" * MAX_CACHE_SALT
    for bad in ["", "x" * (MAX_CACHE_SALT + 1), 5, ["a"], {"a": 1}]:
        with pytest.raises(APIError) as info:
            decode(cache_salt=bad)
        assert (info.value.status, info.value.param) == (400, "cache_salt"), bad
        assert info.value.message.startswith("cache_salt: ")
